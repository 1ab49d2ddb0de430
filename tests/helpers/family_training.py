"""A few training steps of each model family in every parallel layout, through the
trainer's own functions (``build_train_model``, ``Optimizers`` and its step,
``loop.train_step``), one launch per world size: ``lmforge train`` per (family, layout)
would start torchrun, import torch and export a model each time, about 17 s apiece on a
2-core CPU.

``torchrun --nproc-per-node=N family_training.py OUT`` trains every family in each layout
of ``LAYOUTS`` that takes N processes, on the same data; rank 0 first trains the families
as the one plain process those layouts are compared with (``ParallelDims()``, no mesh:
the path of a one-process ``lmforge train``, which touches no process group). Rank 0
writes OUT/results-N.json (``run/family`` -> per-step loss and grad norm and whether a
tied embedding's pipeline copies agree, or the error) and OUT/<run>-<family>.pt (the final
weights).
"""
from __future__ import annotations

import contextlib
import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmforge.config import JobConfig
from lmforge.models.gemma3.model import Gemma3Args
from lmforge.models.gptj.model import GPTJArgs
from lmforge.models.llama.model import LlamaArgs
from lmforge.models.loss import IGNORE_INDEX
from lmforge.models.phi3.model import LongRope, Phi3Args
from lmforge.parallel.mesh import (ParallelDims, build_parallel_dims, init_distributed,
                                   read_dist_env)
from lmforge.train.loop import Runtime, train_step
from lmforge.job import resolve
from lmforge.train.model_setup import TrainModel, build_train_model, gather_full_state_dict
from lmforge.train.optim import Optimizers

STEPS = 4
SEQ_LEN = 24
# 2 layers (one per pp=2 stage), an odd vocabulary that tp=2 shards unevenly, 4 query heads
# over 2 KV heads for tp=2.
_SHAPE = dict(dim=32, n_layers=2, n_heads=4, vocab_size=97, ffn_dim=64, max_seq_len=64)
FAMILIES = {
    # a window of 8 keys, shorter than the 24-token sequence: the banded mask is in play
    "mistral": LlamaArgs(**_SHAPE, n_kv_heads=2, family="mistral", sliding_window=8),
    # tied, as Qwen2/2.5 0.5B and 1.5B: under pp, a copy on the first and on the last stage
    "qwen2": LlamaArgs(**_SHAPE, n_kv_heads=2, family="qwen2", attention_bias=True,
                       tie_embeddings=True),
    # head_dim 16, not dim / n_heads = 8
    "qwen3": LlamaArgs(**_SHAPE, n_kv_heads=2, family="qwen3", qk_norm=True,
                       explicit_head_dim=16),
    # rotary on 4 of 8 head features; no grouped-query attention in GPT-J
    "gptj": GPTJArgs(**_SHAPE, n_kv_heads=4, rotary_dim=4),
    # fused qkv_proj / gate_up_proj split over tp=2 by kv head; rotary on 4 of 8 features;
    # LongRoPE past its original 16 positions (the long factors are in play)
    "phi3": Phi3Args(**_SHAPE, n_kv_heads=2, partial_rotary_factor=0.5, rope_scaling=LongRope(
        short_factor=(1.0, 1.5), long_factor=(2.0, 4.0), original_max_position_embeddings=16,
        attention_factor=1.2)),
    # layer 0 slides over 8 keys, layer 1 is global; four norms per block; tied
    "gemma3": Gemma3Args(**_SHAPE, n_kv_heads=2, explicit_head_dim=16, sliding_window=8,
                         sliding_pattern=2, query_pre_attn_scalar=12.0),
}
LORA = {"lora.enabled": True, "lora.targets": "all-linear", "lora.rank": 4}
DOCUMENTS = "documents"  # (not a config key) each row packs documents: segments, positions
LAYOUTS = {  # name -> (processes, config fields)
    "fsdp_dp2": (2, {"parallel.dp_shard": 2}),
    "tp2_sp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    "pp2": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    "lora_fsdp_dp2": (2, {"parallel.dp_shard": 2, **LORA}),
    # a later stage's input is a sequence slice there (the window mask once failed on it)
    "pp2_tp2_sp": (4, {"parallel.pp": 2, "parallel.tp": 2,
                       "parallel.sequence_parallel": True}),
    # FSDP2 on each stage: a tied weight is sharded on the first and on the last stage
    "pp2_dp2": (4, {"parallel.pp": 2, "parallel.dp_shard": 2}),
    # context parallelism: each sequence in 2 x cp chunks (causal, and the windows of
    # Mistral and Gemma 3 across chunks), packed documents too, and its compositions
    "cp2": (2, {"parallel.cp": 2}),
    "fsdp_dp2_documents": (2, {"parallel.dp_shard": 2, DOCUMENTS: True}),
    "cp2_documents": (2, {"parallel.cp": 2, DOCUMENTS: True}),
    "lora_cp2": (2, {"parallel.cp": 2, **LORA}),
    "cp4_documents": (4, {"parallel.cp": 4, DOCUMENTS: True}),
    "cp2_dp2": (4, {"parallel.cp": 2, "parallel.dp_shard": 2}),
    "cp2_tp2_sp": (4, {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True}),
}
REFERENCES = {"single": {}, "lora_single": LORA, "documents_single": {DOCUMENTS: True}}
# Each layout is compared with this one-process run.
REFERENCE_OF = {name: "lora_single" if fields.get("lora.enabled") else
                "documents_single" if fields.get(DOCUMENTS) else "single"
                for name, (_, fields) in LAYOUTS.items()}


def job_config(fields: dict, world_size: int) -> JobConfig:
    cfg = JobConfig()
    cfg.data.seq_len, cfg.data.micro_batch_size, cfg.data.global_batch_size = SEQ_LEN, 2, 8
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.grad_clip = 1e-2, 0, 0.5
    cfg.train.max_steps, cfg.train.device = STEPS, "cpu"
    cfg.parallel.dp_shard = 1
    for dotted, value in fields.items():
        if dotted == DOCUMENTS:
            continue
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg.validate(world_size=world_size, distributed=world_size > 1)


def step_samples(vocab_size: int, documents: bool = False) -> list[dict]:
    """Each step's 8 sequences (input_ids, labels), a tenth of the labels ignored, so the
    data-parallel ranks hold different valid-token counts. ``documents``: each row packs
    documents of 7, 9 and 8 tokens (segments; positions restarting), as the loader's."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (STEPS, 8, SEQ_LEN + 1), generator=g)
    labels = tokens[..., 1:].clone()
    labels[torch.rand(labels.shape, generator=g) < 0.1] = IGNORE_INDEX
    steps = [{"input_ids": tokens[s, :, :-1], "labels": labels[s]} for s in range(STEPS)]
    if documents:
        lengths = torch.tensor([7, 9, 8])
        segments = torch.repeat_interleave(torch.arange(3), lengths).expand(8, SEQ_LEN)
        starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        positions = (torch.arange(SEQ_LEN) - starts).expand(8, SEQ_LEN)
        for sample in steps:
            sample.update(segments=segments, positions=positions)
            sample["labels"][:, torch.cumsum(lengths, 0)[:-1] - 1] = IGNORE_INDEX  # crossing
    return steps


def rank_micro_batches(sample: dict, cfg: JobConfig, dims: ParallelDims) -> list[dict]:
    """This data-parallel rank's share of the step (a contiguous one: which samples a rank
    gets does not change the step), in micro-batches; the tp and pp ranks of one
    data-parallel group read the same share, as with the trainer's loader."""
    share = {k: v.chunk(dims.dp)[dims.dp_rank] for k, v in sample.items()}
    size = cfg.data.micro_batch_size
    return [{k: v[i:i + size] for k, v in share.items()}
            for i in range(0, len(share["input_ids"]), size)]


def runtime(dims: ParallelDims) -> Runtime:
    """The trainer's Runtime of this process for ``dims``: fp32 on the CPU."""
    rank = dist.get_rank() if dims.mesh is not None else 0
    return Runtime(torch.device("cpu"), contextlib.nullcontext, rank=rank, dims=dims)


def train_family(args, cfg: JobConfig, dims: ParallelDims, documents: bool = False
                 ) -> tuple[dict, dict]:
    """run_loop's step, STEPS times: {"history": per-step (loss, grad norm),
    "tied_copies_equal": ``tied_copies_equal``} and the final weights."""
    world_size = dist.get_world_size() if dims.mesh is not None else 1
    job = resolve(cfg, world_size, distributed=dims.mesh is not None, args=args)
    rt = runtime(dims)
    torch.manual_seed(cfg.train.seed)  # as init_runtime's seed_everything
    model = build_train_model(job, rt.device, dims)
    optimizers = Optimizers(model.parts, cfg.optim, cfg.train.max_steps)
    history = []
    # SDPA's math kernel: each query's row is computed alone, as under context
    # parallelism, where a rank holds some of the queries (the CPU's flash kernel blocks
    # the queries by count, which moves the rounding; Adam's steps then amplify it)
    with sdpa_kernel(SDPBackend.MATH):
        for step, sample in enumerate(step_samples(args.vocab_size, documents), 1):
            result = train_step(cfg, rt, model, optimizers,
                                rank_micro_batches(sample, cfg, dims), step)
            history.append((float(result.loss), float(result.grad_norm)))
    record = {"history": history, "tied_copies_equal": tied_copies_equal(model)}
    return record, gather_full_state_dict(model)


def tied_copies_equal(model: TrainModel) -> bool | None:
    """Whether, on every rank pair, the first stage's and the last stage's copy of a tied
    embedding are bit-equal (None: no copies, untied or not pipelined). The final weights
    show only the last stage's (``gather_full_state_dict`` merges the stages in order)."""
    if model.tied is None:
        return None
    equal = torch.tensor(1)
    if model.tied.weight is not None:
        mine = model.tied.weight.detach()
        mine = mine.to_local() if hasattr(mine, "to_local") else mine  # (a shard)
        first = mine.clone()
        dist.broadcast(first, group=model.tied.group, group_src=0)
        equal = torch.tensor(int(torch.equal(first, mine)))
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    return bool(equal)


def run(name: str, fields: dict, out: Path, world_size: int, results: dict) -> None:
    cfg = job_config(fields, world_size)
    dims = (build_parallel_dims(cfg.parallel, world_size, "cpu") if world_size > 1
            else ParallelDims())
    for family, args in FAMILIES.items():
        try:
            record, weights = train_family(args, cfg, dims, bool(fields.get(DOCUMENTS)))
        except Exception:  # recorded per family; the test of that pair reports it (a
            # failure on some ranks only leaves the others waiting: the test's timeout)
            results[f"{name}/{family}"] = {"error": traceback.format_exc()}
            continue
        if weights is not None:  # global rank 0
            torch.save(weights, out / f"{name}-{family}.pt")
            results[f"{name}/{family}"] = record


def main(out: Path) -> None:
    env = read_dist_env()
    torch.set_num_threads(1)
    init_distributed(env, "cpu", distributed=True)
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None  # (a subset, to debug)
    layouts = {name: fields for name, (nproc, fields) in LAYOUTS.items()
               if nproc == env.world_size and (only is None or name in only)}
    results: dict = {}
    if env.rank == 0:
        for name in sorted({REFERENCE_OF[name] for name in layouts}):
            run(name, REFERENCES[name], out, world_size=1, results=results)
    for name, fields in layouts.items():
        run(name, fields, out, env.world_size, results)
    if env.rank == 0:
        (out / f"results-{env.world_size}.json").write_text(json.dumps(results, indent=1))
    gc.collect()  # as the trainer's _shutdown: free the meshes' groups before destroying
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
