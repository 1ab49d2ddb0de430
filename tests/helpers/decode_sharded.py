"""Run under torchrun (2 processes, gloo): a tiny model's batched decoding sharded by
FSDP2 and by tensor parallelism (tp=2) against the same model in one process; and a tiny
Qwen3.5's (Gated DeltaNet layers, whose state tp splits by heads), also under sequence
parallelism, whose one-token steps carry fillers that must stay out of the state. Writes
OUT/decode-sharded.json on rank 0: per layout, whether every row's tokens are equal and
the largest difference of the model log-probabilities."""
import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from helpers.tiny_models import tiny_llama
from lmforge.models.common import materialize
from lmforge.models.generate import Sampling, generate
from lmforge.models.registry import PRESETS, build_model
from lmforge.parallel.fsdp import apply_fsdp
from lmforge.parallel.tensor import apply_tensor_parallel

PROMPTS = [[(5 * i + j) % 60 + 1 for j in range(n)] for i, n in enumerate([3, 9, 1, 6])]
SAMPLED = Sampling(temperature=0.9, top_k=20, top_p=0.95)


def decode(model) -> list:
    return [generate(model, PROMPTS, 10, s, seeds=[1, 2, 3, 4]) for s in (Sampling(), SAMPLED)]


def compare(ours, reference) -> dict:
    pairs = [(a, b) for run_a, run_b in zip(ours, reference) for a, b in zip(run_a, run_b)]
    return {"same_tokens": all(a.ids == b.ids for a, b in pairs),
            "max_logprob_diff": max(abs(x - y) for a, b in pairs
                                    for x, y in zip(a.model_logprobs, b.model_logprobs))}


def model(name: str):
    torch.manual_seed(0)
    if name == "llama":
        return tiny_llama(seed=4, vocab_size=64).eval()
    args = dataclasses.replace(PRESETS["qwen3.5-debug"], vocab_size=64)
    return materialize(build_model(args), "cpu").eval()


def main(out: Path, name: str) -> None:
    dist.init_process_group("gloo")
    base = model(name)
    reference = decode(base)
    mesh = init_device_mesh("cpu", (2,))
    fsdp = copy.deepcopy(base)
    apply_fsdp(fsdp, mesh, zero=3, param_dtype=None)
    result = {"fsdp2": compare(decode(fsdp), reference)}
    for layout, sequence_parallel in (("tp2", False), ("tp2_sp", True)):
        tp = copy.deepcopy(base)
        apply_tensor_parallel(tp, mesh, sequence_parallel=sequence_parallel)
        result[layout] = compare(decode(tp), reference)
    if dist.get_rank() == 0:
        (out / f"decode-sharded-{name}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
