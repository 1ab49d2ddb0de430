"""Every LoRA mode stopped and resumed, through the trainer itself (``train.loop.train``),
several cases per process: ``lmforge train`` per run would start an interpreter (and
torchrun) each time, three runs per case. The process group lives through every run (a
second one on torchrun's store would not connect): the worker starts it, and the runs'
``_shutdown`` leaves it up.

``[torchrun --nproc-per-node=N] resume_modes.py CORPUS OUT`` runs each case of ``CASES``
that takes N processes three times: 4 steps straight, then stopped after step 2 (its
checkpoint) and resumed (``train.resume=auto``). Pretraining cases read CORPUS (the
``tiny_corpus`` fixture), SFT cases OUT/sft.jsonl (``write_sft_pairs``). Each run's
directory is OUT/<case>/{straight,split}; the test reads their metrics.jsonl and
checkpoints. Rank 0 writes OUT/errors-N.json: case -> the traceback of a case that raised.

"+norms" cases train the norms' and the attention biases' weights beside the adapters
(Qwen2's q/k/v biases): a LoRA run's optimizer then has both parameter groups, matrices
(decay) and vectors (no decay). No config key asks for that; the test patches
``freeze_base``, which decides what trains.
"""
from __future__ import annotations

import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.config import load_config
from lmforge.parallel.mesh import init_distributed, read_dist_env
from lmforge.peft import lora
from lmforge.train import loop

STEPS, STOP_AT = 4, 2
LORA = ["lora.enabled=true", "lora.rank=4", "lora.targets=all-linear"]
QLORA = [*LORA, "lora.quantize=nf4"]
NORMS = ["model.family=qwen2"]  # q/k/v biases to train (with the norms: train_vectors)
SFT = ["data.kind=sft", "data.template=plain"]
# bf16 moments with stochastic rounding, the step fused into backward (no accumulation)
LOW_MEMORY = ["optim.name=adamw_bf16", "optim.in_backward=true", "optim.grad_clip=0",
              "data.global_batch_size=2"]
FSDP = ["parallel.dp_shard=2"]
PP = ["parallel.pp=2"]
CASES = {  # name -> (processes, overrides); "+norms" in the name: vectors train too
    "text/lora": (1, LORA),
    "text/lora+norms": (1, LORA + NORMS),
    "text/qlora": (1, QLORA),
    "text/qlora+norms": (1, QLORA + NORMS),
    "sft/lora": (1, SFT + LORA),
    "sft/lora+norms": (1, SFT + LORA + NORMS),
    "sft/qlora": (1, SFT + QLORA),
    "sft/qlora+norms": (1, SFT + QLORA + NORMS),
    "text/lora/low_memory": (1, LORA + LOW_MEMORY),
    "text/lora/fsdp_dp2": (2, LORA + FSDP),
    "text/lora+norms/fsdp_dp2": (2, LORA + NORMS + FSDP),
    "sft/lora/fsdp_dp2": (2, SFT + LORA + FSDP),
    "sft/lora+norms/fsdp_dp2": (2, SFT + LORA + NORMS + FSDP),
    "text/lora/adamw_bf16/fsdp_dp2": (2, LORA + ["optim.name=adamw_bf16"] + FSDP),
    "text/lora/pp2": (2, LORA + PP),
    "text/lora+norms/pp2": (2, LORA + NORMS + PP),
}


def write_sft_pairs(corpus: Path, out: Path) -> None:
    """OUT/sft.jsonl: 100 prompt/response pairs, consecutive lines of the corpus."""
    lines = (corpus / "corpus.txt").read_text().splitlines()[:200]
    (out / "sft.jsonl").write_text("".join(
        json.dumps({"prompt": p, "response": r}) + "\n" for p, r in zip(lines[::2], lines[1::2])))


def base_overrides(corpus: Path, out: Path, name: str) -> list[str]:
    """The tiny model on the corpus (helpers.runs.tiny_overrides), checkpointed every
    STOP_AT steps, no export; an SFT case reads the prompt/response pairs instead."""
    from helpers.runs import tiny_overrides

    overrides = tiny_overrides(corpus, STEPS) + [
        "train.deterministic=true", f"train.checkpoint_every={STOP_AT}", "train.save=false",
        "train.progress_bar=false", "train.threads=1"]
    if name.startswith("sft/"):
        overrides.append(f"data.path={out / 'sft.jsonl'}")
    return overrides + CASES[name][1]


def train_vectors(model: torch.nn.Module) -> None:
    """``freeze_base``, then the norms' weights and the biases train too."""
    frozen_base(model)
    for name, p in model.named_parameters():
        if p.dtype.is_floating_point and (name.endswith(".bias") or "norm." in name):
            p.requires_grad_(True)


frozen_base = lora.freeze_base


def run_case(corpus: Path, out: Path, name: str) -> None:
    overrides = base_overrides(corpus, out, name)
    lora.freeze_base = train_vectors if "+norms" in name else frozen_base
    try:
        for run, extra in (("straight", []), ("split", [f"train.stop_at_step={STOP_AT}"]),
                           ("split", ["train.resume=auto"])):
            loop.train(load_config(None, overrides + extra +
                              [f"train.output_dir={out / name / run}"]))
    finally:
        lora.freeze_base = frozen_base


def keep_process_group() -> None:
    """``loop._shutdown`` without destroying the process group."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()


def main(corpus: Path, out: Path) -> None:
    env = read_dist_env()
    init_distributed(env, "cpu", distributed=env.world_size > 1)
    loop._shutdown = keep_process_group
    errors = {}
    for name, (nproc, _) in CASES.items():
        if nproc != env.world_size:
            continue
        try:
            run_case(corpus, out, name)
        except Exception:  # recorded per case; the test of that case reports it (a
            # failure on some ranks only leaves the others waiting: the test's timeout)
            errors[name] = traceback.format_exc()
    if env.rank == 0:
        (out / f"errors-{env.world_size}.json").write_text(json.dumps(errors, indent=1))
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
