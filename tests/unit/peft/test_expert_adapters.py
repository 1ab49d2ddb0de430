"""Adapters on the MoE experts (peft's ``target_parameters``) load back into lmforge
(peft/expert_adapters.py): ours into a fresh model with the same logits, peft's own with
peft's logits (Qwen3-MoE, rank and alpha patterns, gpt-oss's layout), ``lmforge lora
merge`` of one with the adapter's logits; bad ones refused in one line before the model is
touched."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_models import random_hf_causal_lm
from lmforge.cli import main
from lmforge.config import LoraConfig
from lmforge.models.hf import load_hf_model
from lmforge.peft import AdapterError, apply_lora, load_adapter, lora_layers, save_adapter
from lmforge.peft.lora import expert_layers

peft = pytest.importorskip("peft")

QWEN = dict(moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, head_dim=24,
            num_hidden_layers=2)
GPT_OSS = dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, intermediate_size=32,
               sliding_window=6, num_hidden_layers=2)
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
GATE_UP0 = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _randomize(named, seed: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named:
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    model = random_hf_causal_lm("qwen3_moe", seed=1, **QWEN)
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def our_adapter(qwen_dir, tmp_path_factory):
    """Ours, all-linear (attention and both stacks), random weights: (dir, logits)."""
    _, path = qwen_dir
    model = load_hf_model(path).eval()
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0, targets="all-linear"))
    _randomize(model.named_parameters())
    out = save_adapter(model, tmp_path_factory.mktemp("ours") / "adapter", str(path))
    with torch.no_grad():
        return out, model(_tokens(model.args.vocab_size))


def _peft_adapter(hf_model, out, **lora):
    """peft's own adapter on ``hf_model`` (q_proj and both stacks unless ``lora`` says
    otherwise), random weights, saved: (dir, peft's logits). ``hf_model`` is left bare."""
    config = peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                "target_parameters": TARGETS, **lora})
    x = _tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        base = hf_model(x).logits
    wrapped = peft.get_peft_model(hf_model, config).eval()
    _randomize(wrapped.named_parameters(), seed=3)
    wrapped.save_pretrained(out)
    with torch.no_grad():
        logits = wrapped(x).logits
    wrapped.unload()
    assert (logits - base).abs().max() > 1e-3  # the adapter matters
    return out, logits


def test_our_adapter_loads_back_into_a_fresh_model_with_the_same_logits(qwen_dir,
                                                                        our_adapter):
    _, path = qwen_dir
    adapter, logits = our_adapter
    fresh = load_hf_model(path).eval()
    described = load_adapter(fresh, adapter)
    assert sorted(expert_layers(fresh)) == ["layers.0.feed_forward.experts",
                                            "layers.1.feed_forward.experts"]
    assert described.targets[-2:] == ["experts.gate_up_proj", "experts.down_proj"]
    with torch.no_grad():
        torch.testing.assert_close(fresh(_tokens(fresh.args.vocab_size)), logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("patterns", [{}, {
    "rank_pattern": {"mlp.experts.gate_up_proj": 2},
    "alpha_pattern": {"mlp.experts.down_proj": 32, "q_proj": 2}}], ids=["plain", "patterns"])
def test_a_peft_written_adapter_loads_with_peft_logits(qwen_dir, tmp_path, patterns):
    hf_model, path = qwen_dir
    adapter, reference = _peft_adapter(hf_model, tmp_path / "adapter", **patterns)
    ours = load_hf_model(path).eval()
    load_adapter(ours, adapter)
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens(ours.args.vocab_size)), reference,
                                   rtol=1e-5, atol=1e-5)
    assert ours.layers["0"].feed_forward.experts.lora["gate_up_proj"].rank == (
        2 if patterns else 4)
    if patterns:  # saved again, the patterns say the same
        config = json.loads((save_adapter(ours, tmp_path / "again") /
                             "adapter_config.json").read_text())
        assert config["rank_pattern"] == {f"model.layers.{i}.mlp.experts.gate_up_proj": 2
                                          for i in range(2)}
        assert set(config["alpha_pattern"]) >= {"model.layers.0.mlp.experts.down_proj"}


def test_a_peft_adapter_on_the_experts_only_loads(qwen_dir, tmp_path):
    """target_modules null: only target_parameters, and only down_proj (peft's key then
    has no base_layer)."""
    hf_model, path = qwen_dir
    adapter, reference = _peft_adapter(hf_model, tmp_path / "adapter", target_modules=None,
                                       target_parameters=["mlp.experts.down_proj"])
    ours = load_hf_model(path).eval()
    load_adapter(ours, adapter)
    assert not lora_layers(ours)
    assert list(ours.layers["1"].feed_forward.experts.lora) == ["down_proj"]
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens(ours.args.vocab_size)), reference,
                                   rtol=1e-5, atol=1e-5)


def test_a_peft_adapter_on_gpt_oss_loads_in_its_layout(tmp_path):
    """gpt-oss's experts are stored transposed with gate and up interleaved."""
    hf_model = random_hf_causal_lm("gpt_oss", seed=1, **GPT_OSS)
    hf_model.save_pretrained(tmp_path / "base")
    adapter, reference = _peft_adapter(hf_model, tmp_path / "adapter")
    ours = load_hf_model(tmp_path / "base").eval()
    load_adapter(ours, adapter)
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens(ours.args.vocab_size)), reference,
                                   rtol=1e-5, atol=1e-5)


def test_lora_merge_of_a_peft_adapter_gives_the_adapters_logits(qwen_dir, tmp_path):
    hf_model, path = qwen_dir
    adapter, reference = _peft_adapter(hf_model, tmp_path / "adapter")
    assert main(["lora", "merge", "--model", str(path), "--adapter", str(adapter),
                 "--output", str(tmp_path / "merged")]) == 0
    merged = load_hf_model(tmp_path / "merged").eval()
    assert not expert_layers(merged) and not lora_layers(merged)
    with torch.no_grad():
        torch.testing.assert_close(merged(_tokens(merged.args.vocab_size)), reference,
                                   rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ refusals

def _copy(adapter, tmp_path):
    out = tmp_path / "edited"
    out.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (out / name).write_bytes((adapter / name).read_bytes())
    return out


def _refused(path, adapter, message: str) -> str:
    model = load_hf_model(path)
    with pytest.raises(AdapterError, match=message) as err:
        load_adapter(model, adapter)
    assert not lora_layers(model) and not expert_layers(model), "the model was changed"
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("entry,message", [
    ("mlp.experts.up_proj", r"target_parameters: 'mlp\.experts\.up_proj' matches no "
                            r"parameter of the base model \(lmforge adapts "
                            r"mlp\.experts\.down_proj, mlp\.experts\.gate_up_proj\)"),
    ("mlp.gate.weight", r"target_parameters: 'mlp\.gate\.weight' matches "
                        r"model\.layers\.0\.mlp\.gate\.weight, not an experts' stacked"),
])
def test_a_target_parameter_the_model_lacks_is_refused(qwen_dir, our_adapter, tmp_path,
                                                       entry, message):
    adapter = _copy(our_adapter[0], tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_parameters"] = [*config["target_parameters"], entry]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    _refused(qwen_dir[1], adapter, message)


def test_an_expert_tensor_of_the_wrong_expert_count_is_refused(qwen_dir, our_adapter,
                                                               tmp_path):
    adapter = _copy(our_adapter[0], tmp_path)
    sd = load_file(adapter / "adapter_model.safetensors")
    sd[GATE_UP0] = sd[GATE_UP0][:-4]  # 7 experts' rows of A
    save_file(sd, str(adapter / "adapter_model.safetensors"))
    _refused(qwen_dir[1], adapter, r"model\.layers\.0\.mlp\.experts\.gate_up_proj lora_A/"
                                   r"lora_B shapes \(28, 64\)/\(48, 32\), expected "
                                   r"\(32, 64\)/\(48, 32\) \(8 experts of rank 4 \(r\)")


def test_an_expert_tensor_of_the_wrong_rank_is_refused(qwen_dir, our_adapter, tmp_path):
    adapter = _copy(our_adapter[0], tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["rank_pattern"] = {"mlp.experts.down_proj": 2}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    _refused(qwen_dir[1], adapter, r"mlp\.experts\.down_proj lora_A/lora_B shapes "
                                   r"\(32, 24\)/\(64, 32\), expected \(16, 24\)/\(64, 16\) "
                                   r"\(8 experts of rank 2 \(rank_pattern\)")


def test_an_expert_tensor_missing_or_stray_is_refused(qwen_dir, our_adapter, tmp_path):
    adapter = _copy(our_adapter[0], tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.down_proj"]  # the file holds both
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    _refused(qwen_dir[1], adapter, r"experts\.base_layer\.lora_A\.weight is not an adapter "
                                   r"of the experts' weights target_parameters names")
    sd = load_file(adapter / "adapter_model.safetensors")
    del sd[GATE_UP0]
    save_file(sd, str(adapter / "adapter_model.safetensors"))
    config["target_parameters"] = TARGETS
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    _refused(qwen_dir[1], adapter, rf"{GATE_UP0.replace('.', '[.]')} is missing")


def test_a_reader_of_linears_only_refuses_an_experts_adapter(qwen_dir, our_adapter):
    """The GGUF LoRA export reads linears' pairs only (adapter_pairs): refused in one line."""
    from lmforge.peft.adapter_spec import adapter_linears, adapter_pairs
    from lmforge.peft.adapters import read_adapter_config

    config, sd = read_adapter_config(our_adapter[0])
    args = load_hf_model(qwen_dir[1]).args
    with pytest.raises(AdapterError, match=r"experts(\.base_layer)? is not a linear layer; "
                                           r"an adapter of target_parameters"):
        adapter_pairs(config, sd, adapter_linears(args), our_adapter[0])


def test_target_parameters_on_a_dense_model_is_refused(lib, tmp_path):
    model = lib.tiny_model()
    apply_lora(model, lib.lora_cfg())
    adapter = save_adapter(model, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(
        config | {"target_parameters": ["mlp.experts.down_proj"]}))
    with pytest.raises(AdapterError, match=r"target_parameters: 'mlp\.experts\.down_proj' "
                                           r"matches no parameter.*no MoE experts"):
        load_adapter(lib.tiny_model(), adapter)
