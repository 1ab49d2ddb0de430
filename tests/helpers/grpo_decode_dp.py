"""Run under torchrun (2 processes, gloo): each rank decodes ITS OWN prompts with one
tiny model sharded by FSDP2 (``generate(group=...)``), rank 0's stopping after 2 tokens,
rank 1's running 12, looking every 2 tokens (so rank 0 is done long before rank 1 and
must keep stepping); greedy and sampled. Then both ranks decode rank 1's prompts with
the model under tensor + sequence parallelism (tp=2: odd prompt widths, one-token steps,
each padded to a multiple of 2). Each rank's tokens and model log-probabilities are
compared with what the unsharded model decodes of the same prompts alone. Writes
OUT/decode-dp.json on rank 0: whether every row's tokens are equal on both ranks, the
largest log-probability difference, and each rank's longest completion."""
import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from helpers.tiny_models import tiny_llama
from lmforge.models.generate import Sampling, generate
from lmforge.parallel.fsdp import apply_fsdp
from lmforge.parallel.tensor import apply_tensor_parallel

PROMPTS = {0: [[3, 9, 4], [7, 1]], 1: [[5, 6, 7, 8, 2], [11], [12, 13]]}
SAMPLED = Sampling(temperature=0.9, top_p=0.95)


def decode(model, prompts, stops, group=None) -> list:
    return [generate(model, prompts, 12, s, stop_ids=stops, seeds=list(range(len(prompts))),
                     sync_every=2, group=group) for s in (Sampling(), SAMPLED)]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = tiny_llama(seed=4, vocab_size=64).eval()
    prompts = PROMPTS[rank]
    stops = []
    if rank == 0:  # every row stops at its second token, greedy or sampled
        stops = sorted({c.ids[1] for run in decode(base, prompts, []) for c in run})
    alone = decode(base, prompts, stops)
    mesh = init_device_mesh("cpu", (2,))
    fsdp = copy.deepcopy(base)
    apply_fsdp(fsdp, mesh, zero=3, param_dtype=None)
    sharded = decode(fsdp, prompts, stops, group=mesh.get_group())
    tp = copy.deepcopy(base)
    apply_tensor_parallel(tp, mesh, sequence_parallel=True)
    sequence_parallel = decode(tp, PROMPTS[1], [])
    pairs = [(a, b) for ra, rb in zip(sharded, alone) for a, b in zip(ra, rb)]
    pairs += [(a, b) for ra, rb in zip(sequence_parallel, decode(base, PROMPTS[1], []))
              for a, b in zip(ra, rb)]
    mine = torch.tensor([float(all(a.ids == b.ids for a, b in pairs)),
                         max(abs(x - y) for a, b in pairs
                             for x, y in zip(a.model_logprobs, b.model_logprobs))])
    lengths = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(lengths, torch.tensor([float(max(len(a.ids) for run in sharded
                                                     for a in run))]))
    both = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(both, mine)
    if rank == 0:
        (out / "decode-dp.json").write_text(json.dumps({
            "same_tokens": all(bool(b[0]) for b in both),
            "max_logprob_diff": max(float(b[1]) for b in both),
            "lengths": [int(x) for x in lengths]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
