"""Our FLOPs count against torch.utils.flop_counter.FlopCounterMode, and the peak table.

What each counts: FlopCounterMode counts the matmuls (mm/addmm/bmm, and SDPA kernels) that
actually run, 2 FLOPs per multiply-add, and nothing else; under the math SDPA backend the
attention is two bmm's over the full S x S scores (the causal mask is applied after, so
the masked half is computed too). We count the same matmuls from the model's shape and
report attention with the causal halving. So:

* ``causal=False``, our count equals FlopCounterMode's exactly, full training and LoRA
  (frozen weights: no weight gradient; no input gradient where nothing upstream trains);
* with the causal halving (what MFU uses) we are lower by exactly half the attention
  products, the stated tolerance: 1 - ours / counted = attention share / 2.
"""
import dataclasses
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.config import LoraConfig
from lmforge.models.deepseek_v3.presets import PRESETS as DEEPSEEK_V3
from lmforge.models.gemma3.model import Gemma3Args
from lmforge.models.grouped_mm import grouped_mm_supported
from lmforge.models.llama import build_llama, materialize
from lmforge.models.phi3.model import Phi3Args
from lmforge.models.presets import PRESETS
from lmforge.models.registry import build_model
from lmforge.peft.lora import prepare_model_for_lora
from lmforge.perf import flops as F
from lmforge.peft.targets import LoraSpec

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

BATCH, SEQ = 2, 32


def counted_training_flops(model, mapping=None) -> int:
    """FLOPs of one forward + backward, as FlopCounterMode sees them (``mapping``: its
    formulas for ops it does not count itself)."""
    tokens = torch.randint(0, model.args.vocab_size, (BATCH, SEQ))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False,
                                                       custom_mapping=mapping) as counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return counter.get_total_flops()


def tiny_model(lora_targets=None):
    torch.manual_seed(0)
    model = build_llama(PRESETS["debug"])
    if lora_targets:
        prepare_model_for_lora(model, LoraConfig(enabled=True, rank=4, targets=lora_targets))
    return materialize(model, "cpu")


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["gate_proj", "down_proj"],
                                     "all-linear"])
def test_count_matches_flop_counter_exactly_without_causal_halving(targets):
    model = tiny_model(targets)
    trainable = F.Trainability.from_model(model)
    ours = F.flops_breakdown(model.args, SEQ, trainable, causal=False).total * BATCH * SEQ
    assert ours == counted_training_flops(model)


def test_causal_count_is_lower_by_half_the_attention():
    model = tiny_model()
    counted = counted_training_flops(model)
    causal = F.flops_breakdown(model.args, SEQ)
    full = F.flops_breakdown(model.args, SEQ, causal=False)
    ours = causal.total * BATCH * SEQ
    tolerance = full.attention / full.total / 2  # the stated gap: half the attention share
    assert 1 - ours / counted == pytest.approx(tolerance, rel=1e-9)
    assert tolerance == pytest.approx(0.035, abs=0.001)  # docs/metrics.md quotes it


def test_full_training_is_6n_plus_causal_attention():
    for name in ("tiny", "llama2-7b", "llama3-8b"):
        args = PRESETS[name]
        for seq in (512, 4096):
            expected = 6 * F.matmul_params(args) + 6 * args.n_layers * seq * args.dim
            assert F.flops_per_token(args, seq) == pytest.approx(expected, rel=1e-12)


def test_lora_costs_about_two_thirds_of_full_training():
    """No weight gradients for the frozen base: ~4N instead of 6N (plus adapters)."""
    args = PRESETS["llama2-7b"]
    full = F.flops_per_token(args, 2048)
    lora = F.flops_per_token(args, 2048, lora=LoraSpec(rank=16, targets=PROJECTIONS))
    assert 0.6 < lora / full < 0.7
    breakdown = F.flops_breakdown(args, 2048, F.Trainability.lora(LoraSpec(targets=("q_proj", "v_proj"))))
    assert breakdown.backward_weight < 0.01 * breakdown.forward


def test_model_flops_reads_lora_from_the_model():
    model = tiny_model(["q_proj", "v_proj"])
    spec = LoraSpec(rank=4, targets=("q_proj", "v_proj"))
    assert F.model_flops_per_token(model, SEQ) == F.flops_per_token(model.args, SEQ, lora=spec)


def test_model_flops_read_what_trains_from_the_trainers_model():
    from lmforge.config import load_config
    from lmforge.job import resolve
    from lmforge.train.model_setup import build_train_model

    cfg = load_config(None, ["model.preset=debug"])
    train_model = build_train_model(resolve(cfg), torch.device("cpu"))
    assert F.Trainability.from_model(train_model) == F.Trainability.full()
    assert F.model_flops_per_token(train_model, SEQ) == F.flops_per_token(train_model.args, SEQ)


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA H200", 989.0), ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0),
    ("NVIDIA L4", 121.0), ("NVIDIA GH200 480GB", 989.0), ("AMD Instinct MI300X", 1307.0),
    ("NVIDIA A10G", None), ("Tesla V100-SXM2-16GB", None), ("NVIDIA H100", None)])
def test_peak_table_matches_device_names_word_by_word(name, tflops):
    assert F.match_peak_tflops(name) == tflops


def test_unknown_accelerator_warns_and_omits_mfu(monkeypatch):
    monkeypatch.delenv(F.PEAK_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    with pytest.warns(UserWarning, match="MFU omitted"):
        assert F.device_peak_flops(torch.device("cuda")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert F.device_peak_flops(torch.device("cuda")) == 756e12


def test_peak_env_overrides_the_table_and_the_cpu_has_no_peak(monkeypatch):
    monkeypatch.delenv(F.PEAK_ENV, raising=False)
    assert F.device_peak_flops(torch.device("cpu")) is None
    monkeypatch.setenv(F.PEAK_ENV, "100")
    assert F.device_peak_flops(torch.device("cpu")) == 100e12
    monkeypatch.setenv(F.PEAK_ENV, "fast")
    with pytest.raises(ValueError, match=F.PEAK_ENV):
        F.device_peak_flops(torch.device("cpu"))


@pytest.mark.parametrize("flags", [dict(family="qwen2", attention_bias=True),
                                   dict(family="qwen3", qk_norm=True, explicit_head_dim=24),
                                   dict(family="mistral", sliding_window=8)])
def test_family_flags_count_exactly_with_attention_sized_by_heads_times_head_dim(flags):
    # head_dim 24 makes n_heads * head_dim (96) differ from dim (64): attention must use it.
    torch.manual_seed(0)
    model = materialize(build_llama(dataclasses.replace(PRESETS["debug"], **flags)), "cpu")
    ours = F.flops_breakdown(model.args, SEQ, causal=False).total * BATCH * SEQ
    assert ours == counted_training_flops(model)


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["fc_in", "fc_out"]])
def test_gptj_parallel_block_counts_exactly(targets):
    """GPT-J: the MLP reads the attention's normalised input, so with a frozen embedding
    and norms (LoRA) neither branch needs an input gradient from the other; the biased
    fc_in, fc_out and head add no matmul FLOPs."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(PRESETS["gptj-tiny"], n_layers=2, vocab_size=256))
    if targets:
        prepare_model_for_lora(model, LoraConfig(enabled=True, rank=4, targets=targets))
    materialize(model, "cpu")
    trainable = F.Trainability.from_model(model)
    ours = F.flops_breakdown(model.args, SEQ, trainable, causal=False).total * BATCH * SEQ
    assert ours == counted_training_flops(model)


def test_sliding_window_shortens_the_causal_attention_count():
    assert F.mean_keys_per_query(32, None) == F.mean_keys_per_query(32, 32) == 16
    assert F.mean_keys_per_query(32, 8) == 8 - 64 / 64  # W - W^2 / 2S
    args = PRESETS["mistral-7b"]
    assert F.flops_per_token(args, 32768) < F.flops_per_token(
        dataclasses.replace(args, sliding_window=None), 32768)


@pytest.mark.parametrize("targets", [None, "all-linear"])
@pytest.mark.parametrize("family", ["phi3", "gemma3"])
def test_families_from_their_own_folders_count_exactly(family, targets):
    """Phi-3's fused qkv_proj and gate_up_proj, Gemma 3's GeGLU, four norms, q/k norms and
    sliding layers: counted from the BlockSpec alone, as FlopCounterMode counts them."""
    args = {"phi3": Phi3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                             ffn_dim=96, partial_rotary_factor=0.5),
            "gemma3": Gemma3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                 ffn_dim=96, explicit_head_dim=24, sliding_window=8,
                                 sliding_pattern=2)}[family]
    torch.manual_seed(0)
    model = build_model(args)
    if targets:
        prepare_model_for_lora(model, LoraConfig(enabled=True, rank=4, targets=targets))
    materialize(model, "cpu")
    trainable = F.Trainability.from_model(model)
    ours = F.flops_breakdown(model.args, SEQ, trainable, causal=False).total * BATCH * SEQ
    assert ours == counted_training_flops(model)


def test_gemma3_sliding_layers_cost_less_than_global_ones_at_long_sequences():
    args = PRESETS["gemma3-1b"]
    all_global = dataclasses.replace(args, layer_types=("global",) * args.n_layers)
    assert F.flops_per_token(args, 32768) < F.flops_per_token(all_global, 32768)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``torch._grouped_mm``, which FlopCounterMode counts as 0: 2 x rows x in x out, the
    (token, expert) assignments' work (as tests/unit/perf/test_flops_moe.py counts it)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


# DeepSeek-V3's debug size at 2 layers (layer 0 dense, layer 1 MoE with a shared expert);
# its multi-head latent attention with a query latent, without one (Moonlight), and with
# a value head (8) narrower than the key's (16)
DEEPSEEK = dataclasses.replace(DEEPSEEK_V3["deepseek-v3-debug"], n_layers=2, vocab_size=256)


@pytest.mark.parametrize("targets", [None, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                            "kv_b_proj", "q_proj", "o_proj"]])
@pytest.mark.parametrize("mla", [{}, dict(q_lora_rank=None), dict(v_head_dim=8)],
                         ids=["q latent", "q_proj", "v head 8"])
def test_deepseek_v3_latent_attention_counts_exactly(mla, targets):
    """MLA's five or six projections (a frozen query latent's input gradient flows through
    q_a_layernorm only where something upstream trains), the score product over the
    qk head dim (nope + rope) and the value product over v_head_dim."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(DEEPSEEK, **mla))
    if targets:
        prepare_model_for_lora(model, LoraConfig(enabled=True, rank=4, targets=targets))
    materialize(model, "cpu")
    grouped_mm_supported("cpu", torch.float32)  # (its cached probe runs a tiny _grouped_mm)
    trainable = F.Trainability.from_model(model)
    ours = F.flops_breakdown(model.args, SEQ, trainable, causal=False).total * BATCH * SEQ
    counted = counted_training_flops(model, {torch.ops.aten._grouped_mm: _grouped_mm_flops})
    assert ours == counted
