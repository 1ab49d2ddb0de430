"""The training entry point: config in, trained model and run directory out.

``train(cfg)`` reads top to bottom as the run happens: runtime, output directory,
tokenizer, data, model, optimizer, the loop, then evaluation, export and a sample.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmforge.config import ConfigError, JobConfig, check_model_args, model_args, save_config
from lmforge.data.build import DataBundle, build_data, train_corpus_tokenizer
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.models.llama import Llama, LlamaArgs, build_llama, count_parameters, materialize
from lmforge.train import metrics as M
from lmforge.train.optim import build_optimizer, build_scheduler
from lmforge.train.step import accumulate_gradients, count_valid_tokens, evaluate


@dataclass
class Runtime:
    device: torch.device
    autocast: object  # a context-manager factory
    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def train(cfg: JobConfig) -> dict:
    """Runs the job described by ``cfg``; returns a summary of what happened."""
    cfg.validate(world_size=1)
    rt = init_runtime(cfg)
    out_dir = prepare_output_dir(cfg)
    tokenizer = prepare_tokenizer(cfg, out_dir)
    args = resolve_model_args(cfg, tokenizer)
    data = build_data(cfg, tokenizer, rt.dp_rank, rt.dp_size, cache_dir=out_dir / "cache")
    model = build_model(cfg, args, rt.device)
    apply_training_wraps(model, cfg)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
    _say(rt, f"model: {count_parameters(model):,} parameters ({_describe(args)}) on "
             f"{rt.device}; data: {data.description}")
    history = run_loop(cfg, rt, model, optimizer, scheduler, data, out_dir)
    summary = finish(cfg, rt, model, tokenizer, data, out_dir, history)
    return summary


# ---------------------------------------------------------------------------- set-up

def init_runtime(cfg: JobConfig) -> Runtime:
    t = cfg.train
    if t.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: cuda requested but no GPU is visible")
    device = torch.device("cuda" if t.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if t.device == "auto" else t.device))
    if t.threads:
        torch.set_num_threads(t.threads)
    seed_everything(t.seed)
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    use_bf16 = t.dtype == "bf16" or (t.dtype == "auto" and device.type == "cuda")
    autocast = (functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
                if use_bf16 else contextlib.nullcontext)
    return Runtime(device=device, autocast=autocast)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_output_dir(cfg: JobConfig) -> Path:
    out = Path(cfg.train.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    except OSError as e:
        raise ConfigError(f"train.output_dir: cannot write to {out} ({e.strerror})") from None
    # A fresh run starts fresh logs; resuming (a later issue) appends.
    if not cfg.train.resume:
        (out / "metrics.jsonl").unlink(missing_ok=True)
    return out


def prepare_tokenizer(cfg: JobConfig, out_dir: Path) -> Tokenizer:
    """The model's tokenizer, or one trained on the corpus (and saved in the run dir)."""
    source = cfg.model.tokenizer or cfg.model.init_from
    if source:
        return load_tokenizer(source)
    saved = out_dir / "tokenizer"
    if (saved / "tokenizer.json").is_file() and cfg.train.resume:
        return load_tokenizer(saved)
    tokenizer = train_corpus_tokenizer(cfg)
    tokenizer.save(saved)
    return load_tokenizer(saved)


def resolve_model_args(cfg: JobConfig, tokenizer: Tokenizer) -> LlamaArgs:
    if cfg.model.init_from:
        from lmforge.models.hf import args_from_hf_config, read_hf_config

        base = args_from_hf_config(read_hf_config(cfg.model.init_from))
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
                     "tie_embeddings"):
            value = getattr(cfg.model, name)
            if value is not None and value != getattr(base, name):
                raise ConfigError(f"model.{name}: {value} differs from {getattr(base, name)} "
                                  f"in {cfg.model.init_from}/config.json (shapes come from "
                                  "the checkpoint)")
        args = model_args(cfg, base=base)
    else:
        args = model_args(cfg)
        if cfg.model.vocab_size is None:  # a from-scratch model takes the tokenizer's size
            args = type(args)(**{**args.__dict__, "vocab_size": tokenizer.vocab_size})
    check_model_args(args, cfg.data.seq_len)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(f"model.vocab_size: {args.vocab_size} is smaller than the "
                          f"tokenizer's {tokenizer.vocab_size} tokens")
    return args


def build_model(cfg: JobConfig, args: LlamaArgs, device: torch.device) -> Llama:
    """Built on the meta device, then materialised where it lives: random init, or the
    weights of ``model.init_from``."""
    if cfg.model.init_from:
        from lmforge.models.hf import load_hf_model

        # fp32 master weights whatever the stored dtype; autocast computes in bf16.
        model = load_hf_model(cfg.model.init_from, device=device, dtype=torch.float32)
        if model.args != args:  # e.g. a longer max_seq_len or another rope theta
            model.args = args
    else:
        model = materialize(build_llama(args), device)
    model.train()
    return model


def apply_training_wraps(model: Llama, cfg: JobConfig) -> None:
    """Activation checkpointing then compile, per block, keeping parameter names."""
    for layer in model.layers.values():
        if cfg.train.activation_checkpointing == "full":
            _checkpoint_forward(layer)
        if cfg.train.compile:
            layer.compile()


def _checkpoint_forward(module: nn.Module) -> None:
    # Replacing the instance's forward (instead of wrapping the module) keeps the
    # parameter names, so checkpoints do not depend on this setting.
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


# ------------------------------------------------------------------------------ loop

def grad_accumulation_steps(cfg: JobConfig, dp_size: int) -> int:
    per_micro_step = cfg.data.micro_batch_size * dp_size
    return (cfg.data.global_batch_size or per_micro_step) // per_micro_step


def run_loop(cfg: JobConfig, rt: Runtime, model: Llama, optimizer, scheduler,
             data: DataBundle, out_dir: Path) -> list[dict]:
    t = cfg.train
    accum = grad_accumulation_steps(cfg, rt.dp_size)
    params = [p for p in model.parameters() if p.requires_grad]
    throughput = M.Throughput(M.flops_per_token(model.args, cfg.data.seq_len),
                              M.device_peak_flops(rt.device), rt.world_size)
    logger = M.MetricsLogger(out_dir, enabled=rt.is_logging_rank)
    bar = _progress_bar(cfg, rt)
    history, tokens_seen = [], 0
    for step in range(1, t.max_steps + 1):
        micro_batches = [data.train.next_batch() for _ in range(accum)]
        n_valid = count_valid_tokens(micro_batches)
        loss = accumulate_gradients(model, micro_batches, rt.device, rt.autocast, n_valid)
        grad_norm = _clip(params, cfg.optim.grad_clip)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += sum(b["input_ids"].numel() for b in micro_batches) * rt.dp_size
        throughput.add(sum(b["input_ids"].numel() for b in micro_batches) * rt.dp_size)
        if step % t.log_every == 0 or step == 1 or step == t.max_steps:
            record = {"loss": float(loss), "lr": lr, "grad_norm": float(grad_norm),
                      **throughput.report(), "peak_mem_gib": M.peak_memory_gib(rt.device),
                      "tokens": tokens_seen, "valid_tokens": n_valid}
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"step {step}: loss is {record['loss']}")
            if t.eval_every and step % t.eval_every == 0 and data.eval_batches:
                record["eval_loss"] = evaluate(model, data.eval_batches(), rt.device,
                                               rt.autocast)[0]
            logger.log(step, record)
            history.append({"step": step, **record})
            _report(rt, bar, step, record)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    logger.close()
    return history


def _clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    # max_norm=inf still returns the total norm, which is logged whether or not we clip.
    return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))


# ------------------------------------------------------------------------- finishing

def finish(cfg: JobConfig, rt: Runtime, model: Llama, tokenizer: Tokenizer, data: DataBundle,
           out_dir: Path, history: list[dict]) -> dict:
    from lmforge.generate import generate
    from lmforge.models.hf import save_hf_model

    summary = {"first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
               "steps": cfg.train.max_steps, "hf_dir": str(out_dir / "hf")}
    if data.eval_batches:
        summary["eval_loss"], summary["eval_tokens"] = evaluate(
            model, data.eval_batches(), rt.device, rt.autocast)
        _say(rt, f"held-out loss {summary['eval_loss']:.4f} "
                 f"(perplexity {math.exp(summary['eval_loss']):.2f})")
    if rt.is_logging_rank:
        save_hf_model(model, out_dir / "hf", tokenizer=tokenizer)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        prompt = tokenizer.encode(cfg.train.sample_prompt, bos=True)
        stops = tuple(i for i in (tokenizer.eos_id,) if i is not None)
        new = generate(model, prompt, cfg.train.sample_tokens, greedy=False, temperature=0.8,
                       top_k=50, stop_ids=stops,
                       generator=torch.Generator().manual_seed(cfg.train.seed))
        summary["sample"] = cfg.train.sample_prompt + tokenizer.decode(new)
        print(f"\nHugging Face export: {out_dir / 'hf'}")
        print(f"sample ({cfg.train.sample_tokens} tokens, temperature 0.8):\n"
              f"{summary['sample']}", flush=True)
    return summary


def _progress_bar(cfg: JobConfig, rt: Runtime):
    show = cfg.train.progress_bar
    if show is None:
        show = sys.stderr.isatty()
    if not (show and rt.is_logging_rank):
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.max_steps, unit="step", dynamic_ncols=True)


def _report(rt: Runtime, bar, step: int, record: dict) -> None:
    if bar is not None:
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        return
    mfu = f" mfu {record['mfu']:.1%}" if record.get("mfu") is not None else ""
    _say(rt, f"step {step:6d}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
             f"grad_norm {record['grad_norm']:.3f}  tokens/s {record['tokens_per_s']:.0f}"
             f"{mfu}  mem {record['peak_mem_gib']:.2f} GiB")


def _say(rt: Runtime, message: str) -> None:
    if rt.is_logging_rank:
        print(message, flush=True)


def _describe(args: LlamaArgs) -> str:
    return (f"dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads / "
            f"{args.n_kv_heads} kv, vocab {args.vocab_size}")
