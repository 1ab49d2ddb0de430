"""The worker of tests/distributed/test_expert_parallel.py: tiny MoE blocks with their
experts split over the ranks (``parallel/expert.py``), each rank feeding its own tokens,
against a one-process copy of the same block fed each rank's tokens in turn.

``torchrun --nproc-per-node=2 expert_parallel.py OUT`` writes OUT/results-RANK.json:
case -> "ok" or the failure's traceback."""
from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lmforge.models.moe import MoE, MoEArgs
from lmforge.parallel.expert import check_ep, full_experts_state_dict, shard_experts

TINY = dict(dim=32, n_experts=8, top_k=2, ffn_dim=16)
ARGS = {
    "swiglu": MoEArgs(**TINY),
    "gpt_oss": MoEArgs(**TINY, router="topk_softmax", router_bias=True,
                       activation="clamped_swiglu", expert_bias=True),
}


def build(args: MoEArgs, seed: int = 0) -> MoE:
    """The same block on every rank, biases non-zero so that they are tested too."""
    torch.manual_seed(seed)
    moe = MoE(args)
    moe.reset_parameters(0.2)
    with torch.no_grad():
        for bias in (moe.gate.bias, moe.experts.gate_up_proj_bias, moe.experts.down_proj_bias):
            if bias is not None:
                bias.normal_(std=0.1)
    return moe


def batches(ranks: int, positive: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's tokens (2, 5, dim), different per rank, and its output's upstream
    gradient."""
    out = []
    for rank in range(ranks):
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(2, 5 + rank, TINY["dim"], generator=gen)  # (batch, seq, dim)
        x = x.abs() + 0.5 if positive else x
        out.append((x, torch.randn(x.shape, generator=gen)))
    return out


def compare(moe: MoE, data: list, mesh) -> None:
    """Output and input gradient as one process's on this rank's tokens; the experts'
    gathered gradients as one process's summed over every rank's tokens."""
    reference = copy.deepcopy(moe)
    shard_experts(moe, mesh)
    rank = dist.get_rank()
    assert moe.experts.gate_up_proj.to_local().shape[0] == TINY["n_experts"] // mesh.size()
    x, grad = data[rank]
    x = x.clone().requires_grad_()
    out, _ = moe(x)
    out.backward(grad)
    for r, (xr, gr) in enumerate(data):
        xr = xr.clone().requires_grad_()
        want, _ = reference(xr)
        want.backward(gr)
        if r == rank:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    gathered = full_experts_state_dict(moe.experts)
    for name, param in reference.experts.named_parameters():
        torch.testing.assert_close(gathered[name], param.detach())
        got = getattr(moe.experts, name).grad.full_tensor()
        torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}.grad: {m}")


def no_local_expert(mesh) -> None:
    """Every token, on both ranks, chooses among rank 1's experts only: rank 0 sends
    itself nothing and receives nothing."""
    moe = build(ARGS["swiglu"])
    with torch.no_grad():
        moe.gate.weight[:4] = -1.0  # positive tokens score experts 0-3 far below the rest
    data = batches(mesh.size(), positive=True)
    chosen = moe.gate(data[dist.get_rank()][0].view(-1, TINY["dim"])).indices
    assert (chosen >= 4).all(), chosen
    compare(moe, data, mesh)


def bad_ep(mesh) -> None:
    try:
        shard_experts(build(MoEArgs(dim=32, n_experts=3, top_k=1, ffn_dim=16)), mesh)
    except ValueError as error:
        assert "parallel.ep" in str(error) and "\n" not in str(error), str(error)
        check_ep(8, 2)  # (and a divisor is taken)
        return
    raise AssertionError("ep=2 with 3 experts was not refused")


CASES = {
    "swiglu": lambda mesh: compare(build(ARGS["swiglu"]), batches(mesh.size()), mesh),
    "gpt_oss": lambda mesh: compare(build(ARGS["gpt_oss"]), batches(mesh.size()), mesh),
    "no_local_expert": no_local_expert,
    "bad_ep": bad_ep,
}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    results = {}
    for name, case in CASES.items():
        try:
            case(mesh)
            results[name] = "ok"
        except Exception:  # (recorded per case: the test reports each one's traceback)
            results[name] = traceback.format_exc()
    (out / f"results-{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
