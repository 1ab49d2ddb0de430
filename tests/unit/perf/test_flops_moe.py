"""FLOPs of a mixture of experts (perf/flops.py: the active parameters) against
torch.utils.flop_counter.FlopCounterMode on a real forward and backward.

FlopCounterMode has no formula for ``torch._grouped_mm`` (it counts 0), which the experts
run as on this CPU. Forcing the padded-bmm fallback would count every expert at the
busiest expert's row count (padding work that depends on the routing), so instead the
counter is given a formula for ``_grouped_mm``: 2 x rows x in x out, the real (token,
expert) assignments' work, which is what model FLOPs count. With it the count is exact
(full training, LoRA on the attention, a dense layer beside the sparse one).

LoRA on the stacked experts is the one place where our count (the low-rank math per
token: 2 r (in + out) per expert applied) differs from what ``peft.expert_lora`` runs
(B A folded into a copy of each stack per forward, whose full weight gradient the grouped
product then computes): the difference is checked against a hand count of that fold.
"""
import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.config import LoraConfig
from lmforge.models.common import materialize
from lmforge.models.grouped_mm import grouped_mm_supported
from lmforge.models.qwen3_moe.model import SparseArgs
from lmforge.models.qwen3_moe.presets import PRESETS
from lmforge.models.registry import build_model
from lmforge.peft.lora import after_materialize, prepare_model_for_lora
from lmforge.perf import flops as F
from lmforge.perf.weights import active_parameters, model_parameters

BATCH, SEQ = 2, 32
TINY = SparseArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=96,
                  max_seq_len=128, qk_norm=True, explicit_head_dim=24, n_experts=8,
                  top_k=2, moe_ffn_dim=32, dense_layers=())
RANK = 4


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """x (rows, in) @ w (groups, in, out) -> (rows, out), and the weight gradient's
    x^T (in, rows) @ dy (rows, out) -> (groups, in, out): 2 x rows x in x out, each row
    multiplied by its own group's weight only."""
    assert len(a_shape) == 2, a_shape
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def counted_training_flops(model) -> int:
    grouped_mm_supported("cpu", torch.float32)  # (its cached probe runs a tiny _grouped_mm)
    tokens = torch.randint(0, model.args.vocab_size, (BATCH, SEQ))
    mapping = {torch.ops.aten._grouped_mm: _grouped_mm_flops}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False,
                                                       custom_mapping=mapping) as counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return counter.get_total_flops()


def tiny_moe(args=TINY, targets=None):
    torch.manual_seed(0)
    model = build_model(args)
    cfg = LoraConfig(enabled=True, rank=RANK, targets=targets)
    if targets:
        prepare_model_for_lora(model, cfg)
    materialize(model, "cpu")
    if targets:
        after_materialize(model, cfg)
    return model


def ours(model) -> float:
    trainable = F.Trainability.from_model(model)
    return F.flops_breakdown(model.args, SEQ, trainable, causal=False).total * BATCH * SEQ


@pytest.mark.parametrize("args", [TINY, dataclasses.replace(TINY, dense_layers=(0,))],
                         ids=["all sparse", "a dense layer 0"])
@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"]])
def test_moe_count_matches_flop_counter_exactly(args, targets):
    model = tiny_moe(args, targets)
    assert ours(model) == counted_training_flops(model)


def test_expert_lora_is_counted_exactly():
    """all-linear: attention and experts adapted. Each adapted stack's product is the
    base's plus two rank-wide grouped products (no fold of B A into the stack), which
    is what the count's per-token low-rank terms are."""
    model = tiny_moe(targets="all-linear")
    trainable = F.Trainability.from_model(model)
    assert dict(trainable.adapters)["experts.down_proj"] == RANK
    assert ours(model) == counted_training_flops(model)


def test_trainability_of_an_moe_reads_router_experts_and_adapters():
    assert F.Trainability.from_model(tiny_moe()) == F.Trainability.full()
    lora = F.Trainability.from_model(tiny_moe(targets="all-linear"))
    assert lora.linears == frozenset()
    assert [name for name, _ in lora.adapters] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]


def test_full_training_is_6_active_parameters_plus_attention():
    args = PRESETS["qwen3-30b-a3b"]
    seq = 4096
    expected = 6 * F.matmul_params(args) + 6 * args.n_layers * seq * args.n_heads * args.head_dim
    assert F.flops_per_token(args, seq) == pytest.approx(expected, rel=1e-12)
    # the matmul weights a token uses are the active parameters less the embedding and
    # the norms (the head is a matmul; the lookup is not)
    norms = args.n_layers * (2 * args.dim + 2 * args.head_dim) + args.dim
    assert F.matmul_params(args) == active_parameters(args) - args.vocab_size * args.dim - norms
    assert F.matmul_params(args) < 0.12 * model_parameters(args)
