"""Phi-3 (fused qkv_proj and gate_up_proj, partial rotary, LongRoPE) loads from a
transformers directory with equal logits and greedy decodes, below and past the
pretraining length; exports back bit-identical; takes LoRA adapters on its fused
projections that peft loads; and keeps the fused rows grouped per kv head."""
from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import ConfigError
from lmforge.models.common import count_parameters
from lmforge.models.hf import HFCheckpointError, load_hf_model
from lmforge.models.phi3.model import qkv_fused
from lmforge.models.presets import PRESETS, check_model_args
from lmforge.models.registry import build_model, family_of
from lmforge.peft.targets import resolve_targets
from helpers.hf_models import random_hf_causal_lm
from helpers.hf_parity import (assert_export_round_trip, assert_greedy_decode_equal,
                               assert_logits_equal, assert_lora_round_trip, tokens)

ORIGINAL = 16  # original_max_position_embeddings of the LongRoPE cases


def _long_rope(rotary_dim: int) -> dict:
    n = rotary_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(n)],
            "long_factor": [1.5 + 0.7 * i for i in range(n)],
            "original_max_position_embeddings": ORIGINAL}


CASES = {  # id -> Phi3Config fields beyond the tiny shape (hidden 64, 4 heads, 2 kv)
    "gqa-partial-rotary-longrope": dict(partial_rotary_factor=0.5, rope_scaling=_long_rope(8),
                                        original_max_position_embeddings=ORIGINAL),
    "mha-tied-window": dict(num_key_value_heads=4, tie_word_embeddings=True,
                            sliding_window=7, vocab_size=97),
}


@pytest.fixture(params=sorted(CASES), scope="module")
def hf_dir(request, tmp_path_factory):
    model = random_hf_causal_lm("phi3", seed=3, **CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def _tokens(vocab: int, seq: int) -> torch.Tensor:
    return tokens(vocab, seq)


@pytest.mark.parametrize("seq", [ORIGINAL - 4, 2 * ORIGINAL - 8])
def test_logits_equal_transformers_below_and_past_the_pretraining_length(hf_dir, seq):
    hf_model, path = hf_dir
    assert_logits_equal(hf_model, path, _tokens(hf_model.config.vocab_size, seq))


@pytest.mark.parametrize("prompt_len,new", [(4, 9), (ORIGINAL + 2, 6)])
def test_greedy_decode_equals_transformers_on_either_side_of_the_switch(hf_dir, prompt_len, new):
    """Both decodes stay on one side of original_max_position_embeddings: transformers
    recomputes the whole cache when a decode crosses it, our KV cache keeps the keys it
    has (the short factors') — see docs/adding-a-family.md."""
    hf_model, path = hf_dir
    prompt = _tokens(hf_model.config.vocab_size, prompt_len)[0].tolist()
    assert_greedy_decode_equal(hf_model, path, prompt, new)


def test_export_is_bit_identical_and_loads_in_transformers(hf_dir, tmp_path):
    hf_model, path = hf_dir
    assert_export_round_trip(hf_model, path, tmp_path / "out",
                             _tokens(hf_model.config.vocab_size, 2 * ORIGINAL - 8),
                             keys=("model_type", "tie_word_embeddings",
                                   "num_key_value_heads", "sliding_window"))


def test_lora_on_the_fused_projections_loads_in_peft_and_merges(hf_dir, tmp_path):
    """Adapters on qkv_proj, o_proj, gate_up_proj and down_proj (peft's names): peft
    loads ours on transformers' model with our logits (so lora_B's rows leave in HF's
    order), and the merged export gives the same logits in transformers."""
    hf_model, path = hf_dir
    adapted = assert_lora_round_trip(hf_model, path, tmp_path,
                                     _tokens(hf_model.config.vocab_size, 12))
    assert {n.rsplit(".", 1)[-1] for n in adapted} == {
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_fused_rows_are_grouped_per_kv_head_so_a_contiguous_shard_holds_its_q_k_v():
    """q: 4 heads, k and v: 2 heads of 3 features. Our rows: kv head 0's two queries, its
    key, its value, then kv head 1's; the first half of the rows (a tp=2 shard) is
    exactly head group 0."""
    class Args:
        n_heads, n_kv_heads, head_dim = 4, 2, 3
    rows = qkv_fused(Args).rows_from_hf().tolist()
    q, k, v = list(range(12)), list(range(12, 18)), list(range(18, 24))
    assert rows == q[:6] + k[:3] + v[:3] + q[6:] + k[3:] + v[3:]
    assert sorted(rows) == list(range(24))


def test_lora_targets_are_the_fused_names_and_a_part_is_refused():
    projections = family_of(PRESETS["phi3-mini-4k"]).projections
    assert resolve_targets("all-linear", projections) == (
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert resolve_targets(["qkv", "mlp.gate_up_proj"], projections) == (
        "qkv_proj", "gate_up_proj")
    with pytest.raises(ConfigError, match="lora.targets: 'q_proj' is computed inside "
                                          "qkv_proj .* target 'qkv_proj'"):
        resolve_targets(["q_proj"], projections)
    with pytest.raises(ConfigError, match="inside gate_up_proj"):
        resolve_targets(["mlp.up_proj"], projections)


def test_bad_long_rope_factors_are_refused_naming_the_field(tmp_path):
    model = random_hf_causal_lm("phi3", seed=0, partial_rotary_factor=0.5,
                                rope_scaling=_long_rope(8),
                                original_max_position_embeddings=ORIGINAL)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    cfg[key]["long_factor"] = cfg[key]["long_factor"][:-1]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=f"{key}.long_factor"):
        load_hf_model(tmp_path)


# Phi-3-mini: 3,821,079,552 (its model card's 3.8B); Phi-4-mini: 3,836,021,760 (3.8B,
# tied). Counted by transformers' Phi3ForCausalLM of the released config on the meta
# device, as test_the_presets_match_transformers_parameter_count does.
@pytest.mark.parametrize("preset", ["phi3-mini-4k", "phi3-mini-128k", "phi4-mini"])
def test_the_presets_match_transformers_parameter_count(preset):
    import transformers
    from lmforge.models.registry import hf_config_from_args

    args = PRESETS[preset]
    check_model_args(args)
    config = transformers.Phi3Config(**{k: v for k, v in hf_config_from_args(args).items()
                                        if k not in ("architectures", "model_type",
                                                     "torch_dtype")})
    with torch.device("meta"):
        reference = transformers.Phi3ForCausalLM(config)
    expected = sum(p.numel() for p in reference.parameters())
    assert count_parameters(build_model(args)) == expected


def test_a_partial_rotary_factor_rotating_an_odd_count_is_refused_naming_the_field():
    import dataclasses
    with pytest.raises(ConfigError, match="model.partial_rotary_factor"):
        check_model_args(dataclasses.replace(PRESETS["phi4-mini"], partial_rotary_factor=0.7))


def test_a_tp_degree_splitting_a_fused_group_is_refused_naming_parallel_tp():
    """gate_up's groups are the hidden units: tp=4 cannot split 6 of them into whole pairs
    (kv heads, 4, would allow it)."""
    import dataclasses
    from lmforge.config import JobConfig
    from lmforge.models.presets import check_layout_fits

    args = dataclasses.replace(PRESETS["phi4-mini"], ffn_dim=6, n_heads=8, n_kv_heads=4)
    cfg = JobConfig()
    cfg.parallel.tp = 4
    with pytest.raises(ConfigError, match="parallel.tp: 4 must divide the 6 groups of the "
                                          "fused gate_up_proj"):
        check_layout_fits(cfg, args)
    cfg.parallel.tp = 2
    check_layout_fits(cfg, args)
