"""LoRA on grouped experts (peft/expert_lora.py) computes what peft 0.21's
``target_parameters`` adapters (``lora.ParamWrapper``) compute on transformers 5's
Qwen3-MoE experts: the same per-expert delta, the same block output, and the adapters
cross into peft through ``to_peft`` under the keys peft itself writes; only the adapters
train; merging equals the adapted forward and leaves gpt-oss's expert biases alone; bad
requests are refused naming what is wrong. fp32 on the CPU, tiny shapes."""
from __future__ import annotations

import pytest
import torch

from lmforge.models import moe_hf
from lmforge.models.moe import MoE, MoEArgs
from lmforge.peft import expert_lora
from lmforge.peft.expert_lora import (LoraGroupedExperts, apply_expert_lora, from_peft,
                                      init_expert_lora, merge_expert_lora, peft_names,
                                      to_peft)

DIM, FFN, EXPERTS, TOP_K, RANK, ALPHA = 16, 12, 4, 2, 2, 6.0  # 2 FFN != DIM, RANK != EXPERTS
# (FFN 12, not 6: torch._grouped_mm wants 16-byte strides, so FFN * 4 bytes % 16 == 0)
PREFIX = "model.layers.0.mlp."
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _hf_qwen3_moe():
    """A one-layer transformers Qwen3-MoE with random expert weights (the same on every
    call), and our block holding the same weights."""
    pytest.importorskip("peft")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=32, hidden_size=DIM, intermediate_size=24,
                            moe_intermediate_size=FFN, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, norm_topk_prob=True,
                            num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(config).eval()
    block = hf.model.layers[0].mlp
    with torch.no_grad():
        for tensor in block.state_dict().values():
            tensor.copy_(torch.randn_like(tensor) * 0.3)
    ours = MoE(MoEArgs(dim=DIM, n_experts=EXPERTS, top_k=TOP_K, ffn_dim=FFN))
    ours.load_state_dict(moe_hf.from_hf(block.state_dict(), "fused"), strict=True)
    return hf, ours.eval()


def _peft_qwen3_moe(rslora: bool = False):
    """``_hf_qwen3_moe`` wrapped by peft with LoRA on both stacked expert weights."""
    from peft import LoraConfig, get_peft_model

    hf, ours = _hf_qwen3_moe()
    peft_model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=[],
                                               target_parameters=TARGETS,
                                               use_rslora=rslora))
    return peft_model, ours


def _peft_block(peft_model):
    return peft_model.base_model.model.model.layers[0].mlp


def _randomize(tensors) -> None:
    with torch.no_grad():
        for t in tensors:
            t.copy_(torch.randn_like(t) * 0.2)


def _our_lora_sd(moe: MoE) -> dict[str, torch.Tensor]:
    return {k: v for k, v in moe.state_dict().items() if ".lora." in k}


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 5, DIM)  # (batch, seq, dim): 30 assignments over 4 experts


@pytest.mark.parametrize("rslora", [False, True])
def test_output_equals_peft_target_parameters_on_transformers_qwen3_moe(rslora):
    """peft's random adapters, read into our block through from_peft: same output."""
    from peft import get_peft_model_state_dict

    peft_model, ours = _peft_qwen3_moe(rslora)
    _randomize(p for n, p in peft_model.named_parameters() if "lora_" in n)
    apply_expert_lora(ours, rank=RANK, alpha=ALPHA, rslora=rslora)
    ours.load_state_dict(from_peft(get_peft_model_state_dict(peft_model), PREFIX, EXPERTS),
                         strict=False)
    x = _x()
    with torch.no_grad():
        want = _peft_block(peft_model)(x)
        got, _ = ours(x)
        with peft_model.disable_adapter():
            base = _peft_block(peft_model)(x)
    assert not torch.allclose(want, base, atol=1e-3)  # the adapters do change the output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_delta_per_expert_equals_peft_get_delta_weight():
    """The layout, expert by expert: our scaling * B_e A_e is peft's delta for expert e."""
    from peft import get_peft_model_state_dict

    peft_model, ours = _peft_qwen3_moe()
    _randomize(p for n, p in peft_model.named_parameters() if "lora_" in n)
    experts = apply_expert_lora(ours, rank=RANK, alpha=ALPHA)
    ours.load_state_dict(from_peft(get_peft_model_state_dict(peft_model), PREFIX, EXPERTS),
                         strict=False)
    down_wrapper = _peft_block(peft_model).experts  # peft nests: down_proj outside
    gate_up_wrapper = down_wrapper.base_layer
    assert (gate_up_wrapper.parameter_name, down_wrapper.parameter_name) == (
        "gate_up_proj", "down_proj")
    with torch.no_grad():
        for name, wrapper in (("gate_up_proj", gate_up_wrapper), ("down_proj", down_wrapper)):
            want = wrapper.get_delta_weight("default")  # (experts, out, in)
            torch.testing.assert_close(experts.lora[name].delta(), want, rtol=1e-6, atol=1e-6)


def test_peft_keys_are_the_ones_peft_writes():
    from peft import get_peft_model_state_dict

    peft_model, _ = _peft_qwen3_moe()
    theirs = get_peft_model_state_dict(peft_model)
    names = peft_names(expert_lora.EXPERT_TARGETS, PREFIX)
    assert sorted(names.values()) == sorted(theirs)
    assert names["experts.lora.gate_up_proj.lora_a"] == (
        "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight")
    assert names["experts.lora.down_proj.lora_b"] == (
        "base_model.model.model.layers.0.mlp.experts.lora_B.weight")
    # one target alone is the outermost (and only) wrapper
    assert peft_names(("down_proj",), PREFIX)["experts.lora.down_proj.lora_a"] == (
        "base_model.model.model.layers.0.mlp.experts.lora_A.weight")


def test_our_adapters_round_trip_into_peft_and_give_the_same_output():
    from peft import set_peft_model_state_dict

    peft_model, ours = _peft_qwen3_moe()
    experts = apply_expert_lora(ours, rank=RANK, alpha=ALPHA)
    _randomize(experts.lora.parameters())
    sd = _our_lora_sd(ours)
    mapped = to_peft(sd, PREFIX)
    back = from_peft(mapped, PREFIX, EXPERTS)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    result = set_peft_model_state_dict(peft_model, mapped)
    assert not [k for k in result.unexpected_keys]
    assert not [k for k in result.missing_keys if "lora_" in k]
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], _peft_block(peft_model)(x),
                                   rtol=1e-5, atol=1e-5)


def test_an_adapter_directory_of_our_tensors_loads_with_peft_from_pretrained(tmp_path):
    """adapter_model.safetensors written from to_peft, beside the adapter_config.json
    peft writes for target_parameters, loads with PeftModel.from_pretrained."""
    from peft import PeftModel
    from safetensors.torch import save_file

    peft_model, ours = _peft_qwen3_moe()
    peft_model.save_pretrained(tmp_path)  # for its adapter_config.json
    experts = apply_expert_lora(ours, rank=RANK, alpha=ALPHA)
    _randomize(experts.lora.parameters())
    save_file(to_peft(_our_lora_sd(ours), PREFIX), str(tmp_path / "adapter_model.safetensors"))
    hf, _ = _hf_qwen3_moe()
    loaded = PeftModel.from_pretrained(hf, tmp_path).eval()
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], _peft_block(loaded)(x), rtol=1e-5, atol=1e-5)


def _block(**fields) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEArgs(dim=DIM, n_experts=EXPERTS, top_k=TOP_K, ffn_dim=FFN, **fields))
    moe.reset_parameters(0.3)
    _randomize(p for n, p in moe.named_parameters() if n.endswith("_bias"))
    return moe


def test_only_adapters_train_and_get_gradients():
    moe = _block(n_shared_experts=1)
    base = {n: p for n, p in moe.named_parameters()}
    experts = apply_expert_lora(moe, rank=RANK, alpha=ALPHA)
    _randomize(experts.lora.parameters())  # B zero would give A no gradient
    assert {n: p for n, p in moe.named_parameters() if ".lora." not in n} == base
    assert sorted(n for n, p in moe.named_parameters() if p.requires_grad) == [
        "experts.lora.down_proj.lora_a", "experts.lora.down_proj.lora_b",
        "experts.lora.gate_up_proj.lora_a", "experts.lora.gate_up_proj.lora_b"]
    moe(_x())[0].square().sum().backward()
    for name, p in moe.named_parameters():
        if ".lora." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_fresh_adapter_is_the_base_block():
    """B zero: the adapted forward (GroupedExperts.forward over weight_of) is the base one."""
    moe = _block(router="topk_softmax", router_bias=True, activation="clamped_swiglu",
                 expert_bias=True, swiglu_limit=1.0)
    x = _x()
    with torch.no_grad():
        want = moe(x)[0]
        apply_expert_lora(moe, rank=RANK, alpha=ALPHA)
        torch.testing.assert_close(moe(x)[0], want, rtol=0, atol=0)


def test_meta_block_takes_adapters_then_initialises_as_peft_does():
    """Adapters added on the meta device reuse the base tensors; after to_empty,
    init_expert_lora draws A from peft's U(-1/sqrt(in), 1/sqrt(in)) and zeroes B, so
    the block is the base block."""
    with torch.device("meta"):
        moe = MoE(MoEArgs(dim=DIM, n_experts=EXPERTS, top_k=TOP_K, ffn_dim=FFN))
    base = dict(moe.named_parameters())
    apply_expert_lora(moe, rank=RANK, alpha=ALPHA)
    assert all(p.is_meta for p in moe.parameters())
    assert {n: p for n, p in moe.named_parameters() if ".lora." not in n} == base
    moe.to_empty(device="cpu")
    torch.manual_seed(0)
    moe.reset_parameters(0.3)
    assert init_expert_lora(moe) == 2
    for name, in_features in (("gate_up_proj", DIM), ("down_proj", FFN)):
        adapter = moe.experts.lora[name]
        assert adapter.lora_a.abs().max() <= in_features ** -0.5
        assert adapter.lora_a.abs().max() > 0.5 * in_features ** -0.5
        assert not adapter.lora_b.any()
    x = _x()
    with torch.no_grad():
        adapted = moe(x)[0]
        merge_expert_lora(moe)
        torch.testing.assert_close(moe(x)[0], adapted, rtol=0, atol=0)


@pytest.mark.parametrize("targets", [("gate_up_proj", "down_proj"), ("down_proj",)])
def test_merge_equals_adapted_forward_and_leaves_gpt_oss_biases_alone(targets):
    moe = _block(router="topk_softmax", router_bias=True, activation="clamped_swiglu",
                 expert_bias=True, swiglu_limit=1.0)
    base_sd = {k: v.clone() for k, v in moe.state_dict().items()}
    experts = apply_expert_lora(moe, targets=targets, rank=RANK, alpha=ALPHA)
    assert sorted(experts.lora) == sorted(targets)
    _randomize(experts.lora.parameters())
    x = _x()
    with torch.no_grad():
        adapted = moe(x)[0]
        merge_expert_lora(moe)
        merged = moe(x)[0]
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    assert not isinstance(moe.experts, LoraGroupedExperts)
    assert sorted(moe.state_dict()) == sorted(base_sd)
    for key, before in base_sd.items():
        changed = key in {f"experts.{t}" for t in targets}
        assert torch.equal(moe.state_dict()[key], before) != changed, key


def test_bad_requests_are_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="'up_proj'"):
        apply_expert_lora(_block(), targets=("gate_up_proj", "up_proj"))
    with pytest.raises(ValueError, match="none given"):
        apply_expert_lora(_block(), targets=())
    assert sorted(apply_expert_lora(_block(), targets="down_proj").lora) == ["down_proj"]
    with pytest.raises(ValueError, match="dropout"):
        apply_expert_lora(_block(), dropout=0.1)
    with pytest.raises(ValueError, match="rank"):
        apply_expert_lora(_block(), rank=0)
    moe = _block()
    apply_expert_lora(moe)
    with pytest.raises(ValueError, match="already"):
        apply_expert_lora(moe)
    with pytest.raises(ValueError, match="lora_A.weight: missing"):
        from_peft({}, PREFIX, EXPERTS)
