"""Expert parallelism with ep dividing dp_shard in `lmforge estimate` and `lmforge plan`
(docs/estimate.md, "Mixture of experts"; issue 46): each rank's n_experts / ep experts
FSDP-sharded over the dp_shard / ep ranks holding the same ones (torchtitan's layout), so
at rest every rank holds 1 / dp_shard of the experts whatever ep is, and FSDP gathers the
local stack whole for its layer; LoRA adapters on the experts split with them; the layout
search tries every ep dividing both dp_shard and the experts. ep = dp_shard alone is
measured in tests/distributed/test_estimate_ep.py."""
import dataclasses

import pytest

from lmforge.config import load_config
from lmforge.perf.buffers import fsdp_buffers, stage_gradients
from lmforge.perf.estimate import estimate_memory, static_terms
from lmforge.perf.estimate_setup import DTYPE_BYTES, compute_bytes, setup_from_config
from lmforge.perf.layout_search import layouts, meshes, plan, plan_args
from lmforge.perf.timing import DEVICES, expert_dp_seconds
from lmforge.perf.weights import stage_weights

LORA = ["lora.enabled=true", "lora.targets=all-linear", "lora.dropout=0"]


def moe_setup(dp_shard: int, ep: int, extra=(), dp_replicate: int = 1):
    """qwen3-moe-debug (16 experts of width 64, top 4; layer 0 dense, layer 1 an MoE) on
    dp_replicate x dp_shard GPUs, bf16."""
    cfg = load_config(None, ["model.preset=qwen3-moe-debug", "data.seq_len=128",
                             "train.device=cuda", "train.dtype=bf16",
                             f"parallel.dp_shard={dp_shard}", f"parallel.ep={ep}",
                             f"parallel.dp_replicate={dp_replicate}", *extra])
    return setup_from_config(cfg, device="cuda", world_size=dp_shard * dp_replicate)


def local_stack(setup) -> int:
    """One MoE layer's routed experts on one expert-parallel rank, whole (elements)."""
    a = setup.args
    return a.n_experts // setup.ep * 3 * a.dim * a.moe_ffn_dim


@pytest.mark.parametrize("dp_shard, ep, dp_replicate, shard, in_fsdp",
                         [(8, 1, 1, 1, False), (8, 8, 1, 1, False), (8, 2, 1, 4, True),
                          (8, 4, 1, 2, True), (4, 4, 2, 1, True), (4, 2, 2, 2, True)])
def test_which_ranks_shard_the_local_experts(dp_shard, ep, dp_replicate, shard, in_fsdp):
    """dp_shard / ep ranks hold the same experts and shard them; FSDP holds them whenever
    any rank holds the same ones (ep < dp_shard, or HSDP's replicas)."""
    setup = moe_setup(dp_shard, ep, dp_replicate=dp_replicate)
    assert (setup.expert_shard, setup.experts_in_fsdp) == (shard, in_fsdp)


@pytest.mark.parametrize("extra", [[], LORA], ids=["full", "lora"])
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_at_rest_every_rank_holds_a_dp_shard_share_whatever_ep(ep, extra):
    """Weights, optimizer states and the step's gradients: E / ep experts over dp_shard /
    ep ranks is 1 / dp_shard of them, as FSDP without ep; LoRA's expert adapters too."""
    base, split = moe_setup(8, 1, extra), moe_setup(8, ep, extra)
    for a, b in zip(static_terms(base, stage_weights(base, 0)).values(),
                    static_terms(split, stage_weights(split, 0)).values()):
        assert b == pytest.approx(a, rel=1e-9)
    assert (stage_gradients(split, stage_weights(split, 0), 0).total
            == pytest.approx(stage_gradients(base, stage_weights(base, 0), 0).total))


@pytest.mark.parametrize("zero", [3, 2])
def test_fsdp_gathers_the_local_experts_whole_for_their_layer(zero):
    """Below ep = dp_shard FSDP gathers this rank's E / ep experts (in the compute dtype)
    with their block: of the blocks gathered at once (two under zero 3, every one under
    zero 2) those of MoE layers, one in the debug model (layer 0 is dense); at ep =
    dp_shard they are never gathered."""
    buffers = {}
    for ep in (2, 4, 8):
        s = moe_setup(8, ep, [f"parallel.zero={zero}"])
        w = stage_weights(s, 0)
        buffers[ep] = (fsdp_buffers(s, w, stage_gradients(s, w, 0), 0), local_stack(s))
    c = compute_bytes(moe_setup(8, 2))
    (two, stack2), (four, stack4), (eight, _) = buffers[2], buffers[4], buffers[8]
    assert two.params_in_blocks - four.params_in_blocks == pytest.approx(c * (stack2 - stack4))
    assert four.params_in_blocks - eight.params_in_blocks == pytest.approx(c * stack4)
    kept = 1 if zero == 2 else 0  # (zero 2 keeps every block gathered after forward)
    assert four.params_outside_blocks - eight.params_outside_blocks == pytest.approx(
        kept * c * stack4)


def test_the_local_experts_gradients_are_reduce_scattered_below_ep_equal_dp_shard():
    """A block's backward: the local experts' fp32 reduce-scatter input (and the down
    stack's unsharded gradient beyond its shard) exist below ep = dp_shard only."""
    out = {}
    for ep in (4, 8):
        s = moe_setup(8, ep)
        w = stage_weights(s, 0)
        out[ep] = fsdp_buffers(s, w, stage_gradients(s, w, 0), 0)
    s = moe_setup(8, 4)
    a, grad_bytes = s.args, DTYPE_BYTES[s.cfg.train.param_dtype]  # (fp32 parameters)
    stack4, down4 = 4 * 3 * a.dim * a.moe_ffn_dim, 4 * a.dim * a.moe_ffn_dim
    first = out[4].gradients_first_block - out[8].gradients_first_block
    last = out[4].gradients_last_block - out[8].gradients_last_block
    assert last == pytest.approx(grad_bytes * down4 * (2 - 1) / 2)  # 1 of 2 shards beyond
    assert first - last == pytest.approx(4 * stack4)  # the reduce-scatter's fp32 input


def test_lora_on_the_experts_splits_the_adapters_with_the_experts():
    """ep = dp_shard: this rank's 16 / 4 experts and their rank-8 adapters are whole on it
    (the base frozen in bf16); the adapters' optimizer state is that of 1 / 4 of them."""
    s = moe_setup(4, 4, LORA)
    w, a = stage_weights(s, 0), s.args
    local, d, f, r = a.n_experts // 4, a.dim, a.moe_ffn_dim, s.lora.rank
    adapters = local * r * ((d + 2 * f) + (f + d))  # gate_up (d -> 2f), down (f -> d)
    assert w.ep_trainable_params == adapters
    assert w.ep_frozen_bytes == 2 * local * 3 * d * f
    assert w.ep_mlp_out_trainable == local * r * (f + d)
    one = moe_setup(4, 1, LORA)
    assert (estimate_memory(s).components["optimizer states"]
            == pytest.approx(estimate_memory(one).components["optimizer states"]))


def test_expert_traffic_gathers_and_reduces_over_the_ranks_holding_the_same_experts():
    h100 = DEVICES["h100"]
    assert expert_dp_seconds(moe_setup(8, 8), h100, 8) == (0.0, 0.0, 0.0)
    gather, reduce, replicate = expert_dp_seconds(moe_setup(8, 2), h100, 8)
    assert gather > 0 and reduce > 0 and replicate == 0
    # frozen experts: nothing to reduce (the ring's 3 steps of latency alone)
    assert expert_dp_seconds(moe_setup(8, 2, LORA), h100, 8)[1] == pytest.approx(
        3 * h100.intra.latency_us * 1e-6)
    gather, reduce, replicate = expert_dp_seconds(moe_setup(4, 4, dp_replicate=2), h100, 8)
    assert gather == reduce == 0.0 and replicate > 0  # HSDP: the replicas all-reduce


def test_plan_tries_every_ep_dividing_dp_shard_and_the_experts():
    """12 experts on 8 GPUs: ep 2 and 4 (not 8) of dp_shard 8, ep 2 and 4 of dp_shard 4
    beside dp_replicate 2, ep 2 of dp_shard 2; every layout tried is one the trainer
    takes; a dense model gets no ep."""
    cfg = load_config(None, ["model.preset=qwen3-moe-debug", "model.n_experts=12",
                             "data.seq_len=128", "train.device=cuda"])
    args = plan_args(cfg)
    found = {(m["parallel.dp_replicate"], m["parallel.dp_shard"], m["parallel.ep"])
             for m in meshes(args, 8, 8)}
    assert found == {(1, 8, 1), (1, 8, 2), (1, 8, 4), (2, 4, 1), (2, 4, 2), (2, 4, 4),
                     (4, 2, 1), (4, 2, 2), (8, 1, 1)}
    tried = list(layouts(cfg, args, 8, 8))
    result = plan(cfg, 8, 8, dataclasses.replace(DEVICES["h100"], memory_gib=1e6))
    assert result.tried == len(tried)
    assert {c.setup.ep for c in result.candidates} == {1, 2, 4}
    dense = load_config(None, ["model.preset=debug", "data.seq_len=128"])
    assert all(m["parallel.ep"] == 1 for m in meshes(plan_args(dense), 8, 8))


def test_plan_of_an_expert_parallel_config_tries_ep_1_too():
    """A config's own parallel.ep is a layout key like the others: the search sets it
    on every mesh (ep = 1 included), and reads the model on one device with ep = 1."""
    cfg = load_config(None, ["model.preset=qwen3-moe-debug", "data.seq_len=128",
                             "train.device=cuda", "parallel.dp_shard=4", "parallel.ep=4"])
    found = {(m["parallel.dp_shard"], m["parallel.ep"]) for m in meshes(plan_args(cfg), 4, 8)}
    assert {(4, 1), (4, 2), (4, 4), (1, 1)} <= found
