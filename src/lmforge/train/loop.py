"""The training entry point: config in, trained model and run directory out.

``train(cfg)`` reads top to bottom as the run happens: runtime, output directory,
tokenizer (``train.setup``), data, model, optimizer, resume, the loop (with checkpoints:
``train.checkpoints``), then evaluation, export and a sample (``train.finish``).
"""
from __future__ import annotations

import functools
import gc
import sys
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from lmforge.config import JobConfig, harness_task_names, warmup_warning
from lmforge.config.paths import with_absolute_paths
from lmforge.data.build import DataBundle, build_data, check_data
from lmforge.eval.harness import check_tasks
from lmforge.job import Job, resolve
from lmforge.models.common import count_parameters
from lmforge.models.registry import build_model
from lmforge.parallel.mesh import DistEnv, read_dist_env, runs_distributed
from lmforge.parallel.offload import offload_summary
from lmforge.peft.lora import trainable_summary
from lmforge.peft.targets import model_projections, resolve_targets
from lmforge.perf.auto_batch import size_micro_batch
from lmforge.perf.budget import require_fit
from lmforge.perf.flops import device_peak_flops, model_flops_per_token
from lmforge.train import metrics as M
from lmforge.train.balance import ExpertBalance
from lmforge.train.checkpoints import Checkpoints
from lmforge.train.finish import finish
from lmforge.train.model_setup import TrainModel, build_train_model, clip_grad_norm
from lmforge.train.optim import Optimizers
from lmforge.train.precision import LossScaler, device_notes
from lmforge.train.preempt import StopSignals
from lmforge.train.preference import mean_stats
from lmforge.train.reference import (attach_reference_model, check_reference,
                                     precompute_reference)
from lmforge.train.progress import Progress, evaluation_plan, summary_lines
from lmforge.train.resume_check import resume_changes
from lmforge.train.run_dir import CHECKPOINTS, RunClaim
from lmforge.train.setup import (Runtime, check_resume_path, data_source, init_runtime,
                                 prepare_output_dir, prepare_tokenizer, say, start_run)
from lmforge.train.step import (StepResult, check_finite, global_step_loss, sample_ids,
                                step_counts)
from lmforge.train.trackers import check_trackers

__all__ = ["Runtime", "check_job", "prepare_output_dir", "run_loop", "train", "train_step"]


def train(cfg: JobConfig) -> dict:
    """Runs the job described by ``cfg``; returns a summary of what happened."""
    cfg = with_absolute_paths(cfg)  # (a reward's os.chdir cannot move the run's files)
    env = read_dist_env()
    job = check_job(cfg, env)
    require_fit(job, env.local_rank)  # before any allocation or write
    if env.rank == 0 and (warning := warmup_warning(cfg)):
        print(warning, file=sys.stderr, flush=True)
    summary = _run(job, init_runtime(job, env))
    # The model, optimizers and mesh died with _run's frame: only now can the process
    # groups they held be destroyed for good (see _shutdown).
    _shutdown()
    return summary


def check_job(cfg: JobConfig, env: DistEnv) -> Job:
    """What ``train`` refuses before any set-up (also ``train --dry-run``'s check), for
    ``env``'s processes: the resolved job (``job.resolve``), the resume path, the data."""
    distributed = runs_distributed(cfg.parallel, env.world_size, env.torchrun)
    # data.micro_batch_size=auto: a number for this device (recorded so in config.yaml)
    cfg, sized = size_micro_batch(cfg, env.world_size, distributed, env.local_rank)
    job = resolve(cfg, env.world_size, distributed=distributed)
    check_resume_path(cfg.train.resume, Path(cfg.train.output_dir) / CHECKPOINTS)
    check_reference(job)  # a resumed preference run's precomputed reference/
    changes = resume_changes(job)  # (a changed model or objective is refused)
    tasks = harness_task_names(cfg.eval.harness_tasks)
    if tasks:  # not hours later, after the last step
        check_tasks(tasks, cfg.eval.harness_include_path,
                    ("eval.harness_tasks", "eval.harness_include_path"))
    check_trackers(cfg.metrics)  # a required tracker's server: before the run dir
    check_data(cfg)  # last: it may read a whole text corpus
    if env.rank == 0:  # once every check passed: a refusal stays one line
        if sized:
            print(sized, flush=True)
        for line in changes:
            print(line, file=sys.stderr, flush=True)
    return job


def _run(job: Job, rt: Runtime) -> dict:
    out_dir, claim = prepare_output_dir(job.config, rt)
    try:
        return _run_in(job, rt, out_dir, claim)
    except BaseException:
        if claim is not None and not claim.started:
            claim.undo()  # refused before it started: the run directory as it was
        raise
    finally:
        if claim is not None:
            claim.release()


def _run_in(job: Job, rt: Runtime, out_dir: Path, claim: Optional[RunClaim]) -> dict:
    """Set-up, then (once nothing is left to refuse: ``start_run``) the run."""
    cfg = job.config
    tokenizer = prepare_tokenizer(cfg, out_dir, rt, claim)
    job = job.with_tokenizer(tokenizer.vocab_size)
    args = job.args
    say(rt, f"data: reading and tokenizing {data_source(cfg)}")
    data = build_data(cfg, tokenizer, rt.dp_rank, rt.dp_size, cache_dir=out_dir / "cache")
    say(rt, "model: building" + (f", loading {cfg.model.init_from}"
                                  if cfg.model.init_from else ""))
    model = build_train_model(job, rt.device, rt.dims, rt.param_dtype)
    attach_reference_model(model, job, rt.device, rt.dims, rt.param_dtype)
    optimizers = Optimizers(model.parts, cfg.optim, cfg.train.max_steps,
                            LossScaler.for_job(job, rt.device, rt.is_logging_rank))
    say(rt, f"model: {count_parameters(build_model(args)):,} parameters ({_describe(args)}) "
             f"on {rt.world_size} x {rt.device.type} ({_layout(rt)}); data: {data.description}")
    for note in data.notes:
        say(rt, note)
    for note in device_notes(job.compute, rt.device.type):
        say(rt, note)
    if cfg.lora.enabled:
        targets = resolve_targets(cfg.lora.targets, model_projections(model.parts[0]))
        say(rt, f"LoRA rank {cfg.lora.rank} on {', '.join(targets)}"
                 f"{', ' + cfg.lora.quantize + ' base' if cfg.lora.quantize else ''}: "
                 f"{trainable_summary(model.parts[0])}"
                 f"{' (stage 0)' if len(model.parts) > 1 or rt.dims.pp > 1 else ''}")
    if cfg.train.activation_offload:
        say(rt, offload_summary(rt.device, cfg.train.activation_checkpointing))
    say(rt, evaluation_plan(cfg, data))
    # (before a resume loads trained weights: the reference is the starting model)
    precompute_reference(model, cfg, {"train": data.train, "eval": data.held_out},
                         out_dir, rt.device, rt.autocast, rt.is_logging_rank)
    checkpoints = Checkpoints(cfg, rt, out_dir)
    start_step = checkpoints.resume(model, optimizers, data, job)
    logger = M.MetricsLogger(out_dir, cfg.metrics, enabled=rt.is_logging_rank,
                             config=cfg.to_dict(), start_step=start_step)
    try:
        start_run(cfg, rt, claim)  # config.yaml
        return _train_and_finish(job, rt, model, optimizers, tokenizer, data, out_dir,
                                 checkpoints, logger, start_step)
    finally:
        logger.close()


def _train_and_finish(job: Job, rt: Runtime, model: TrainModel, optimizers: Optimizers,
                      tokenizer, data: DataBundle, out_dir: Path, checkpoints: "Checkpoints",
                      logger: "M.MetricsLogger", start_step: int) -> dict:
    """The steps from ``start_step`` on, then the end of the run (``finish``), or the
    checkpoint a preemption or train.stop_at_step leaves it at."""
    cfg = job.config
    end_step = min(cfg.train.max_steps, cfg.train.stop_at_step or cfg.train.max_steps)
    progress = Progress(cfg, rt.is_logging_rank, start_step, end_step, rt.started)
    # SIGUSR1/SIGTERM/SIGINT: checkpoint this step, leave (rank 0 says so when it comes)
    with StopSignals(rt.device, announce=rt.is_logging_rank) as stop:
        history = run_loop(job, rt, model, optimizers, data, out_dir, checkpoints, logger,
                           start_step, end_step, progress, stop)
    if stop.stopped_at is not None:
        say(rt, f"preempted at step {stop.stopped_at}: checkpoint written, exiting; "
                 f"requeue resumes (train.resume=auto)")
        return {"preempted_at": stop.stopped_at, "history": history}
    if end_step < cfg.train.max_steps:
        say(rt, "\n".join(summary_lines(progress.summary(out_dir, history, rt.device, data))))
        say(rt, f"stopped after step {end_step} of {cfg.train.max_steps} "
                 f"(train.stop_at_step); continue with train.resume=auto")
        return {"stopped_at": end_step, "history": history}
    return finish(cfg, rt, model, tokenizer, data, out_dir, history, logger, progress)


def _shutdown() -> None:
    """Ends the process groups while the interpreter is whole. Modules, DTensors and the
    device mesh hold references to their groups in reference cycles; collecting them first
    lets ``destroy_process_group`` free the gloo/NCCL groups now rather than during
    interpreter teardown, where gloo can abort the process after a successful run."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


# ------------------------------------------------------------------------------ loop

def run_loop(job: Job, rt: Runtime, model: TrainModel, optimizers: Optimizers,
             data: DataBundle, out_dir: Path, checkpoints: "Checkpoints",
             logger: "M.MetricsLogger", start_step: int = 0, end_step: Optional[int] = None,
             progress: Optional[Progress] = None,
             stop: Optional[StopSignals] = None) -> list[dict]:
    cfg, t = job.config, job.config.train
    accum = job.batch.accumulation
    # by sequence length: SFT batches are as long as their longest sample
    flops_per_token = functools.lru_cache()(functools.partial(model_flops_per_token, model))
    throughput = M.Throughput(flops_per_token(cfg.data.seq_len), device_peak_flops(rt.device),
                              rt.world_size)
    end_step = end_step or t.max_steps
    progress = progress or Progress(cfg, rt.is_logging_rank, start_step, end_step)
    # The whole run's records (rank 0): an earlier invocation's, then this one's.
    history, nonfinite_steps = list(logger.earlier), 0
    progress.starting(start_step + 1, accum)  # the first step can take minutes: say so
    tokens = checkpoints.tokens  # positions the run's steps ran over (metrics "tokens")
    for step in range(start_step + 1, end_step + 1):
        fresh = model.objective.takes_new_batches(step)  # (GRPO may train a rollout again)
        micro_batches = [data.train.next_batch() for _ in range(accum if fresh else 0)]
        # (GRPO: its rollout, the completions of these prompts; the others: as read)
        micro_batches, made = model.objective.prepare(model, micro_batches, step, rt.device,
                                                      rt.autocast)
        started = time.perf_counter()
        result = train_step(cfg, rt, model, optimizers, micro_batches, step, flops_per_token)
        if made:  # the split users ask for: generating, scoring, training
            made = {**made, "time/train_s": time.perf_counter() - started}
        nonfinite_steps += not result.finite
        throughput.add(result.counts.positions, result.counts.flops)
        tokens += result.counts.positions
        evaluate_now = eval_due(cfg, step, data)
        # a stop signal: this step is the run's last for now, so it is logged too (once
        # the next step reads new data: GRPO checkpoints no rollout it would reuse)
        preempted = (stop is not None and model.objective.takes_new_batches(step + 1)
                     and stop.should_stop(step))
        logged = evaluate_now or preempted or step % t.log_every == 0
        if logged or step in (start_step + 1, end_step):
            record = {"loss": float(result.loss), "lr": result.lr,
                      "grad_norm": None if result.grad_norm is None
                      else float(result.grad_norm),
                      **throughput.report(), **M.memory_metrics(rt.device),
                      "tokens": tokens,
                      model.objective.unit: result.n_valid, "nonfinite_steps": nonfinite_steps,
                      "consumed_samples": data.train.consumed_samples,
                      **optimizers.scaler.metrics(), **result.metrics, **made,
                      **(sample_ids(micro_batches) if t.log_sample_ids else {})}
            if evaluate_now:
                record.update(evaluate_held_out(rt, model, data))
                throughput.reset()  # the evaluation's time is not the next steps'
            logger.log(step, record)
            history.append({"step": step, **record})
            progress.logged(step, record)
        checkpoints.after_step(step, model, optimizers, data, final=step == end_step,
                               now=preempted, tokens=tokens)
        progress.advance(result.counts.positions)
        if preempted:
            break
    checkpoints.wait()
    progress.close()
    return history


def train_step(cfg: JobConfig, rt: Runtime, model: TrainModel, optimizers: Optimizers,
               micro_batches: list[dict], step: int, flops_per_token=None) -> StepResult:
    """Optimizer step ``step`` over this rank's ``micro_batches``: forward/backward, the
    step loss, fp16's unscaling, clipping, the non-finite check, then the update (skipped
    on a non-finite step; the LR schedule advances regardless). ``flops_per_token``: by
    sequence length, for the step's FLOPs (``step_counts``)."""
    scaler = optimizers.scaler  # fp16's loss scale (a no-op otherwise)
    counts = step_counts(micro_batches, rt.dims, rt.device, flops_per_token, model.objective)
    stats: dict = {}
    balance = ExpertBalance.of(model.parts[0], len(micro_batches))  # (None: dense)
    local_loss = model.forward_backward(micro_batches, counts.valid, rt.device, rt.autocast,
                                        scaler.scale, stats, balance)
    loss = global_step_loss(local_loss, rt.dims)
    scaler.unscale(optimizers.optimizers)  # the true gradients, for the norm and clipping
    # With the update fused into backward no gradient outlives its parameter's step.
    grad_norm = None if cfg.optim.in_backward else clip_grad_norm(model, cfg.optim.grad_clip)
    lr = optimizers.lr
    # fp16: gradients that overflowed are the scaler's to skip, not a non-finite step.
    finite = check_finite(rt, step, local_loss, loss, None if scaler.enabled else grad_norm,
                          micro_batches, cfg.train.on_nonfinite)
    optimizers.step(update=finite, step=step)
    metrics = mean_stats(stats, rt.dims, counts.valid)
    if balance is not None:
        dims = rt.dims
        balance.reduce(dims.group(dims.dp_cp_group)
                       if dims.mesh is not None and dims.dp * dims.cp > 1 else None)
        metrics |= balance.metrics()
        if finite and cfg.train.expert_bias_update:
            balance.update_biases(cfg.train.expert_bias_update)
    return StepResult(loss, local_loss, grad_norm, counts, lr, finite, metrics)


def eval_due(cfg: JobConfig, step: int, data: DataBundle) -> bool:
    """Every ``train.eval_every`` steps and after the run's last step, whether or not the
    step is a logged one. A function of the step alone, so every rank enters the
    evaluation (collective under FSDP, tensor and pipeline parallelism) together."""
    every = cfg.train.eval_every
    return data.eval_batches is not None and (
        step == cfg.train.max_steps or bool(every and step % every == 0))


def evaluate_held_out(rt: Runtime, model: TrainModel, data: DataBundle) -> dict:
    """The objective's held-out metrics (``eval_loss`` first), on any layout."""
    return model.objective.held_out(model, data.eval_batches(), rt.device, rt.autocast)


def _layout(rt: Runtime) -> str:
    d = rt.dims
    return (f"pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} "
            f"x tp {d.tp}"
            + (", FSDP2" if d.uses_fsdp else ""))


def _describe(args) -> str:
    return (f"{args.family}, dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads / "
            f"{args.n_kv_heads} kv, vocab {args.vocab_size}")
