"""Run under torchrun (2 processes, gloo): each rank decodes ITS OWN prompts with one tiny
Qwen3-MoE (qwen3-moe-debug, 3 layers: a dense one, then two of 16 experts, top-4) whose
experts are split over the two ranks
(``parallel.expert.shard_experts``: every MoE forward an all-to-all of the tokens), with
``generate(group=...)``: rank 0's rows stop after 2 tokens, rank 1's run 12, the decoder
looking every 2 tokens, so rank 0 is done long before rank 1 and must keep stepping;
greedy and sampled. Each rank's tokens and model log-probabilities are compared with what
the whole model decodes of the same prompts alone (its experts packed for the CPU decode:
``models.packed_linear``). Writes OUT/ep-decode.json on rank 0: whether every row's tokens
are equal on both ranks, the largest log-probability difference, each rank's longest
completion and forwards run, and how many expert stacks were packed, under ep and alone."""
import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lmforge.models.common import materialize
from lmforge.models.generate import Sampling, generate
from lmforge.models.moe import MoE
from lmforge.models.registry import PRESETS, build_model
from lmforge.parallel.expert import shard_experts

PROMPTS = {0: [[3, 9, 4], [7, 1]], 1: [[5, 6, 7, 8, 2], [11], [12, 13]]}
SAMPLED = Sampling(temperature=0.9, top_p=0.95)


def decode(model, prompts, stops, group=None) -> list:
    return [generate(model, prompts, 12, s, stop_ids=stops, seeds=list(range(len(prompts))),
                     sync_every=2, group=group) for s in (Sampling(), SAMPLED)]


def _watch(model) -> dict:
    """Counts ``model``'s forwards and the most expert stacks packed in one."""
    counts = {"forwards": 0, "packed": 0}

    def count(module, _):
        counts["forwards"] += 1
        counts["packed"] = max(counts["packed"],
                               sum("product" in m.__dict__ for m in module.modules()))

    model.register_forward_pre_hook(count)
    return counts


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(4)
    args = dataclasses.replace(PRESETS["qwen3-moe-debug"], n_layers=3, vocab_size=64,
                               max_seq_len=64)
    base = materialize(build_model(args, "meta"), "cpu").eval()
    prompts = PROMPTS[rank]
    stops = []
    if rank == 0:  # every row stops at its second token, greedy or sampled
        stops = sorted({c.ids[1] for run in decode(base, prompts, []) for c in run})
    whole = _watch(base)
    alone = decode(base, prompts, stops)
    mesh = init_device_mesh("cpu", (2,))
    ep = copy.deepcopy(base)
    for layer in ep.layers.values():
        if isinstance(layer.feed_forward, MoE):
            shard_experts(layer.feed_forward, mesh)
    counts = _watch(ep)
    sharded = decode(ep, prompts, stops, group=mesh.get_group())
    pairs = [(a, b) for ra, rb in zip(sharded, alone) for a, b in zip(ra, rb)]
    mine = torch.tensor([float(all(a.ids == b.ids for a, b in pairs)),
                         max(abs(x - y) for a, b in pairs
                             for x, y in zip(a.model_logprobs, b.model_logprobs)),
                         max(len(a.ids) for run in sharded for a in run), counts["forwards"],
                         counts["packed"], whole["packed"]])
    both = [torch.zeros(6, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(both, mine.double())
    if rank == 0:
        (out / "ep-decode.json").write_text(json.dumps({
            "same_tokens": all(bool(b[0]) for b in both),
            "max_logprob_diff": max(float(b[1]) for b in both),
            "lengths": [int(b[2]) for b in both], "forwards": [int(b[3]) for b in both],
            "packed": [int(b[4]) for b in both],
            "packed_alone": [int(b[5]) for b in both]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
