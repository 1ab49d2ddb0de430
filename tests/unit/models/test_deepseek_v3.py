"""DeepSeek-V3 (models/deepseek_v3) against transformers' own on tiny random models (norms
and the routers' correction biases randomised: transformers sets them to constants,
which would hide a mapping mistake): equal logits, equal greedy decodes alone and in a
batch, an export whose files hold the original per-expert tensors bit for bit and that
transformers loads with equal logits; dense layers before the sparse ones; the released
configs read as the presets, whose parameter counts are transformers'; MTP layers dropped
by the documented rule; FP8, a missing expert and routing we do not compute refused in
one line naming the field or tensor."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_models import random_hf_causal_lm
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                               assert_logits_equal, assert_lora_round_trip, tokens)
from lmforge.config import ConfigError
from lmforge.models.common import count_parameters, materialize
from lmforge.models.deepseek_v3 import DeepseekV3Args
from lmforge.models.hf import (HFCheckpointError, load_hf_model, read_model_args,
                               save_hf_model)
from lmforge.models.moe import MoE, take_routings
from lmforge.models.presets import check_model_args
from lmforge.models.registry import PRESETS, args_from_hf_config, build_model

TINY = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=10, intermediate_size=96, moe_intermediate_size=24,
            n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=3,
            first_k_dense_replace=1)
# Original context 32, so the decodes' and logits' positions reach past it.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.707, "mscale_all_dim": 1.0}
CASES = {  # id -> config fields
    # a query latent; 4 groups of 2 experts, 2 groups open per token; renormalised
    "q-lora-groups": dict(TINY, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True),
    # Moonlight's shape: q_proj, one group, 2 shared experts, raw weights; YaRN; tied
    "q-proj-yarn-tied": dict(TINY, q_lora_rank=None, n_group=1, topk_group=1,
                             norm_topk_prob=False, routed_scaling_factor=2.446,
                             n_shared_experts=2, num_hidden_layers=2, rope_parameters=YARN,
                             tie_word_embeddings=True),
}


def random_deepseek(seed: int = 1, **config):
    model = random_hf_causal_lm("deepseek_v3", seed=seed, **config)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape))
    return model


@pytest.fixture(params=sorted(CASES), scope="module")
def hf_dir(request, tmp_path_factory):
    model = random_deepseek(**CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def test_logits_equal_transformers(hf_dir):
    hf_model, path = hf_dir
    assert_logits_equal(hf_model, path, tokens(hf_model.config.vocab_size, 40))


def test_greedy_decode_equals_transformers_alone_and_in_a_batch(hf_dir):
    hf_model, path = hf_dir
    prompt = tokens(hf_model.config.vocab_size, 6)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, 30)  # (past YaRN's 32 positions)


def test_export_keeps_the_checkpoint_tensors_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    assert_export_round_trip(
        hf_model, path, tmp_path / "out", tokens(hf_model.config.vocab_size, 24),
        keys=("model_type", "architectures", "tie_word_embeddings", "intermediate_size",
              "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
              "moe_intermediate_size", "n_group", "topk_group", "norm_topk_prob",
              "routed_scaling_factor", "first_k_dense_replace", "num_nextn_predict_layers",
              "num_key_value_heads"))
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in exported
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in exported
    assert read_model_args(tmp_path / "out") == read_model_args(path)


def test_lora_on_the_default_targets_loads_in_peft(hf_dir, tmp_path):
    """The attention's query/key/value projections (peft has no default for DeepSeek-V3)."""
    hf_model, path = hf_dir
    layers = assert_lora_round_trip(hf_model, path, tmp_path,
                                    tokens(hf_model.config.vocab_size, 12), targets=None)
    q = ("q_a_proj", "q_b_proj") if hf_model.config.q_lora_rank else ("q_proj",)
    assert {name.rsplit(".", 1)[-1] for name in layers} == {*q, "kv_a_proj_with_mqa",
                                                          "kv_b_proj"}


def test_lora_on_attention_and_experts_loads_in_peft_and_the_merged_export_agrees(
        hf_dir, tmp_path):
    """all-linear: the attention's linears and the routed experts' stacked weights (the
    dense layers' and shared experts' MLPs take none, as peft reads it)."""
    hf_model, path = hf_dir
    layers = assert_lora_round_trip(hf_model, path, tmp_path,
                                    tokens(hf_model.config.vocab_size, 12))
    assert all(".attention." in name for name in layers)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_the_first_layers_are_dense_and_the_correction_bias_loads(hf_dir):
    hf_model, path = hf_dir
    model = load_hf_model(path)
    kinds = [type(layer.feed_forward).__name__ for layer in model.layers.values()]
    assert kinds == ["GatedMLP"] + ["MoE"] * (len(kinds) - 1)
    theirs = hf_model.model.layers[1].mlp.gate.e_score_correction_bias
    ours = model.layers["1"].feed_forward.gate.e_score_correction_bias
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


# ---------------------------------------------------------------- released configs

V3_CONFIG = {  # deepseek-ai/DeepSeek-V3's config.json (less auto_map and token ids)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}
MOONLIGHT_CONFIG = {  # moonshotai/Moonlight-16B-A3B's config.json, the fields that differ
    **{k: v for k, v in V3_CONFIG.items() if k not in ("quantization_config", "rope_scaling")},
    "first_k_dense_replace": 1, "hidden_size": 2048, "intermediate_size": 11264,
    "max_position_embeddings": 8192, "moe_intermediate_size": 1408, "n_group": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0, "q_lora_rank": None, "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0, "routed_scaling_factor": 2.446, "topk_group": 1,
    "vocab_size": 163840}


def test_released_configs_read_as_the_presets():
    bf16_v3 = {k: v for k, v in V3_CONFIG.items() if k != "quantization_config"}
    assert args_from_hf_config(bf16_v3) == PRESETS["deepseek-v3"]
    assert args_from_hf_config(MOONLIGHT_CONFIG) == PRESETS["moonlight-16b-a3b"]


def test_presets_have_transformers_parameter_counts():
    """transformers' counts (DeepseekV3ForCausalLM from the configs above, summed on the
    meta device): 671B without the MTP layer, and Moonlight's 16B."""
    assert count_parameters(build_model(PRESETS["deepseek-v3"])) == 671_026_404_352
    assert count_parameters(build_model(PRESETS["moonlight-16b-a3b"])) == 15_960_108_544


def test_args_survive_their_json_record():
    for name in ("deepseek-v3", "moonlight-16b-a3b", "deepseek-v3-debug"):
        recorded = json.loads(json.dumps(dataclasses.asdict(PRESETS[name])))
        assert DeepseekV3Args.from_dict(recorded) == PRESETS[name]


def test_the_debug_preset_initialises_routes_and_trains():
    torch.manual_seed(0)  # (every expert is chosen by some token with this draw)
    model = materialize(build_model(PRESETS["deepseek-v3-debug"]), "cpu")
    logits = model(tokens(259, 16))
    assert logits.shape == (2, 16, 259) and torch.isfinite(logits).all()
    assert len(take_routings(model)) == 2  # layers 1 and 2; layer 0 is dense
    assert all(m.gate.e_score_correction_bias.abs().sum() == 0
               for m in model.modules() if isinstance(m, MoE))
    logits.logsumexp(-1).mean().backward()
    # (the router learns through the chosen experts' weights; the bias is a buffer)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# ------------------------------------------------- converted and spoiled checkpoints

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved tiny model's directory, its config and its tensors, to spoil copies of."""
    path = tmp_path_factory.mktemp("saved")
    random_deepseek(**CASES["q-lora-groups"]).save_pretrained(path)
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


def _write(path, config, tensors):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("field, value, match", [
    ("scoring_func", "softmax", r"scoring_func = 'softmax' is not supported"),
    ("topk_method", "greedy", r"topk_method = 'greedy' is not supported"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("n_group", 3, "n_group: 3 does not split"),
    ("first_k_dense_replace", 4, "first_k_dense_replace: 4 is more than the 3 layers"),
    ("quantization_config", V3_CONFIG["quantization_config"], r"quantization_config .*'fp8'"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "rope_type = 'linear'"),
])
def test_configs_it_cannot_compute_are_refused_naming_the_field(saved, tmp_path, field, value,
                                                                match):
    config, tensors = saved
    path = _write(tmp_path, config | {field: value}, tensors)
    with pytest.raises(HFCheckpointError, match=match):
        read_model_args(path)


def test_a_checkpoint_missing_an_expert_is_refused_naming_the_tensor(saved, tmp_path):
    config, tensors = saved
    tensors = {k: v for k, v in tensors.items()
               if k != "model.layers.2.mlp.experts.7.up_proj.weight"}
    with pytest.raises(HFCheckpointError,
                       match=r"model\.layers\.2\.mlp\.experts\.7\.up_proj\.weight: missing"):
        load_hf_model(_write(tmp_path, config, tensors))


def test_fp8_block_scales_are_refused_naming_the_tensor(saved, tmp_path):
    config, tensors = saved
    scale = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"
    with pytest.raises(HFCheckpointError, match=rf"{scale}: FP8 weights"):
        load_hf_model(_write(tmp_path, config, tensors | {scale: torch.ones(1, 1)}))


def test_the_mtp_layers_the_config_declares_are_dropped_and_no_others(saved, tmp_path):
    """Layer 3 of a 3-layer model is the MTP layer when num_nextn_predict_layers is 1."""
    config, tensors = saved
    mtp = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    path = _write(tmp_path, config | {"num_nextn_predict_layers": 1}, tensors | mtp)
    plain = _write(tmp_path / "plain", config, tensors)
    x = tokens(config["vocab_size"], 8)
    torch.testing.assert_close(load_hf_model(path)(x), load_hf_model(plain)(x))
    _write(path, config | {"num_nextn_predict_layers": 0}, tensors | mtp)
    with pytest.raises(HFCheckpointError, match=r"unexpected: model\.layers\.3\."):
        load_hf_model(path)


def test_a_bf16_checkpoint_keeps_its_fp32_correction_bias_bit_for_bit(saved, tmp_path):
    """As DeepSeek's released files: bf16 weights, the correction biases fp32."""
    config, tensors = saved
    bias = "e_score_correction_bias"
    mixed = {k: v if k.endswith(bias) else v.to(torch.bfloat16) for k, v in tensors.items()}
    model = load_hf_model(_write(tmp_path / "bf16", config | {"torch_dtype": "bfloat16"}, mixed))
    ours = model.layers["2"].feed_forward.gate.e_score_correction_bias
    assert model.output.weight.dtype == torch.bfloat16 and ours.dtype == torch.float32
    assert torch.equal(ours, tensors[f"model.layers.2.mlp.gate.{bias}"])
    save_hf_model(model, tmp_path / "out")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == mixed.keys()
    assert all(exported[k].dtype == v.dtype and torch.equal(exported[k], v)
               for k, v in mixed.items())


def test_a_top_k_beyond_the_open_groups_is_refused_naming_the_field():
    args = dataclasses.replace(PRESETS["deepseek-v3-debug"], top_k=9)
    with pytest.raises(ConfigError, match=r"model\.top_k: 9 > the 8 experts of topk_groups"):
        check_model_args(args)
