"""What a run shows while it trains and when it ends (logging rank only).

On a terminal, a progress bar: step/total, elapsed and ETA (tqdm's), and the last logged
loss, lr, grad norm, tokens/s and held-out loss. Without one (a SLURM log, a pipe), one
line per logged step that carries ``step N/M``, elapsed time and ETA itself. The run ends
with a summary block (``summary_lines``), the same facts as ``summary.json``.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from lmforge.checkpoint import latest_checkpoint
from lmforge.config import JobConfig
from lmforge.data.build import DataBundle
from lmforge.perf.records import METRICS_FILE
from lmforge.train.metrics import memory_metrics
from lmforge.train.run_dir import CHECKPOINTS


class Progress:
    """The loop's progress: a bar or log lines, and its timing for the summary.

    ``enabled``: this is the logging rank (the others keep the timing, say nothing);
    ``started``: when this invocation began (``time.perf_counter``), for its wall time."""

    def __init__(self, cfg: JobConfig, enabled: bool, start_step: int = 0,
                 end_step: Optional[int] = None, started: Optional[float] = None):
        self.cfg = cfg
        self.max_steps = cfg.train.max_steps
        self.start_step = start_step
        self.end_step = end_step or self.max_steps
        self.enabled = enabled
        self.bar = _progress_bar(cfg, start_step) if enabled else None
        self.invocation_started = started or time.perf_counter()
        self.started = time.perf_counter()  # the loop's start
        self.loop_s: Optional[float] = None  # the loop's seconds, once it has ended
        self.tokens = 0  # trained by this invocation
        self.last_eval: Optional[float] = None

    def starting(self, step: int, micro_batches: int) -> None:
        """Said as this invocation's first step begins: before it ends (minutes, for a
        large model on a slow device) nothing else would show that the run is training."""
        if step > self.end_step:
            return
        d = self.cfg.data
        self.say(f"step {step} of {self.max_steps} started: {micro_batches} x "
                 f"{d.micro_batch_size} sequences of {d.seq_len} tokens per rank; the first "
                 f"step is the slowest (memory allocation, kernel warm-up)")

    def advance(self, tokens: int) -> None:
        """One step done, ``tokens`` trained in it (all ranks together)."""
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(1)

    def logged(self, step: int, record: dict) -> None:
        """A logged step's record: on the bar, or as one line."""
        if record.get("eval_loss") is not None:
            self.last_eval = record["eval_loss"]
        if not self.enabled:
            return
        if self.bar is None:
            elapsed = self.elapsed()
            self.say(step_line(step, self.max_steps, record, elapsed,
                               self.eta(step, elapsed)))
            return
        self.bar.set_postfix(_postfix(record, self.last_eval), refresh=False)
        if "eval_loss" in record:  # kept in the scrollback, not only on the bar
            self.say(f"step {step}/{self.max_steps}  {eval_text(record)}")

    def say(self, message: str) -> None:
        """One line, above the bar when there is one."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def eta(self, step: int, elapsed: float) -> Optional[float]:
        """Seconds to ``max_steps`` at this invocation's pace so far."""
        done = step - self.start_step
        if done <= 0:
            return None
        return elapsed / done * (self.max_steps - step)

    def close(self) -> None:
        self.loop_s = self.elapsed()
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def summary(self, out_dir: Path, history: list[dict], device: torch.device,
                data: Optional[DataBundle] = None) -> dict:
        """What ``summary.json`` holds. Losses and tokens are the whole run's (``history``
        begins with the records an earlier invocation wrote to metrics.jsonl); wall time
        and tokens/s are this invocation's. The held-out loss is the last evaluation's
        (``eval_step``), or ``eval_note`` says why there is none."""
        cfg, last = self.cfg, history[-1] if history else {}
        newest = latest_checkpoint(out_dir / CHECKPOINTS)
        ended = cfg.train.save and last.get("step") == cfg.train.max_steps
        # (GRPO's evaluation logs a reward, no loss: eval_prompts says it ran)
        evaluated = [r for r in history
                     if r.get("eval_loss") is not None or "eval_prompts" in r]
        held_out = evaluated[-1] if evaluated else {}
        return {"first_loss": history[0]["loss"] if history else None,
                "last_loss": last.get("loss"),
                "eval_loss": held_out.get("eval_loss"),
                "eval_tokens": held_out.get("eval_tokens"), "eval_step": held_out.get("step"),
                **{k: held_out[k] for k in PAIR_KEYS + REWARD_KEYS if k in held_out},
                "eval_note": None if evaluated else no_evaluation(cfg, data,
                                                                  last.get("step", 0)),
                "steps": cfg.train.max_steps, "step": last.get("step", 0),
                "start_step": self.start_step,
                # (a number: data.micro_batch_size=auto as the run sized it)
                "micro_batch_size": cfg.data.micro_batch_size,
                "wall_time_s": time.perf_counter() - self.invocation_started,
                "tokens": last.get("tokens", 0),
                "tokens_per_s": self.tokens / self.loop_s if self.loop_s else None,
                **memory_metrics(device),
                "checkpoint": str(newest) if newest else None,
                "hf_dir": str(out_dir / "hf") if ended else None,
                "adapter_dir": str(out_dir / "adapter") if ended and cfg.lora.enabled
                else None,
                "metrics": str(out_dir / METRICS_FILE)}


def evaluation_plan(cfg: JobConfig, data: DataBundle) -> str:
    """One line saying when the run evaluates and on what, or why it does not."""
    if data.eval_batches is None:
        return f"evaluation: none, {data.eval_note}"
    every = cfg.train.eval_every
    when = (f"every {every} steps (train.eval_every) and at the end" if every
            else "at the end (train.eval_every=0)")
    return (f"evaluation: {when}, on up to {cfg.train.eval_batches} batches "
            f"(train.eval_batches) of held-out data: {data.eval_note}")


def no_evaluation(cfg: JobConfig, data: Optional[DataBundle], step: int) -> str:
    """Why a run that stopped after ``step`` has no held-out loss."""
    if data is None or data.eval_batches is None:
        return "no held-out data" + (f": {data.eval_note}" if data and data.eval_note else "")
    every, steps = cfg.train.eval_every, cfg.train.max_steps
    if every and step < min(every, steps):
        return (f"stopped at step {step}; train.eval_every={every} evaluates first at step "
                f"{min(every, steps)}")
    if not every and step < steps:
        return (f"stopped at step {step}; train.eval_every=0 evaluates only at the last "
                f"step, {steps}")
    return "no evaluation recorded in metrics.jsonl"


def _progress_bar(cfg: JobConfig, start_step: int):
    show = cfg.train.progress_bar
    if show is None:
        show = sys.stderr.isatty()
    if not show:
        return None
    from tqdm import tqdm  # only when a bar is shown

    return tqdm(total=cfg.train.max_steps, initial=start_step, unit="step",
                dynamic_ncols=True)


def _postfix(record: dict, last_eval: Optional[float]) -> dict:
    shown = {"loss": f"{record['loss']:.3f}", "lr": f"{record['lr']:.2e}",
             "grad_norm": fmt(record.get("grad_norm")),
             "tok/s": f"{record['tokens_per_s']:.0f}"}
    if last_eval is not None:
        shown["eval"] = f"{last_eval:.3f}"
    return shown


def step_line(step: int, max_steps: int, record: dict, elapsed: float,
              eta: Optional[float]) -> str:
    """A logged step as one log line (no terminal)."""
    mfu = f"  mfu {record['mfu']:.1%}" if record.get("mfu") is not None else ""
    held_out = f"  {eval_text(record)}" if "eval_loss" in record else ""
    return (f"step {step}/{max_steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"grad_norm {fmt(record.get('grad_norm'))}  "
            f"tokens/s {record['tokens_per_s']:.0f}{mfu}  "
            f"mem {record['peak_mem_gib']:.2f} GiB{held_out}  "
            f"elapsed {duration(elapsed)}  ETA {duration(eta)}")


# a preference run's held-out counts (its eval_loss is per pair: no perplexity)
PAIR_KEYS = ("eval_pairs", "eval_rewards/accuracies", "eval_rewards/margins")
# a GRPO run's held-out reward (train/grpo.py: GRPO.held_out)
REWARD_KEYS = ("eval_reward", "eval_prompts")


def eval_text(record: dict) -> str:
    return f"eval_loss {record['eval_loss']:.4f} ({_held_out(record)})"


def _held_out(s: dict) -> str:
    if s.get("eval_pairs") is not None:
        return (f"reward accuracy {s['eval_rewards/accuracies']:.3f}, margin "
                f"{s['eval_rewards/margins']:.3f}, {s['eval_pairs']:,} held-out pairs")
    return (f"perplexity {_perplexity(s['eval_loss'])}, {s['eval_tokens']:,} held-out "
            f"tokens")


def _perplexity(loss: float) -> str:
    return f"{math.exp(loss):.2f}" if loss < 700 else "inf"


def fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def duration(seconds: Optional[float]) -> str:
    """``H:MM:SS`` (``?`` when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


# --------------------------------------------------------------------------- summary

def summary_lines(summary: dict) -> list[str]:
    """The block a run ends with, from the ``summary.json`` dict."""
    s = summary
    steps = f"{s['step']} of {s['steps']}"
    if s.get("start_step"):
        steps += f" (this invocation: {s['start_step'] + 1}-{s['step']})"
    rows = [("steps", steps),
            ("wall time", f"{duration(s['wall_time_s'])} (this invocation)"),
            ("tokens", f"{s['tokens']:,} ({_rate(s['tokens_per_s'])} tokens/s in this "
                       f"invocation's steps)"),
            ("peak memory", _memory(s)),
            ("train loss", f"{_loss(s['first_loss'])} at the first logged step, "
                           f"{_loss(s['last_loss'])} at the last")]
    earlier = s.get("eval_step") not in (None, s["step"])
    at = f", at step {s['eval_step']}" if earlier else ""
    if s.get("eval_loss") is not None:
        rows.append(("eval loss", f"{s['eval_loss']:.4f} ({_held_out(s)}{at})"))
    elif s.get("eval_prompts") is not None:  # GRPO: the mean weighted reward, greedy
        reward = s.get("eval_reward")
        rows.append(("eval reward", f"{'n/a' if reward is None else f'{reward:.4f}'} "
                                    f"({s['eval_prompts']:,} held-out prompts, greedy{at})"))
    else:
        rows.append(("eval loss", f"none ({s.get('eval_note') or 'no held-out data'})"))
    for metric, value in (s.get("harness") or {}).items():
        rows.append((metric.removeprefix("harness/"), f"{value:.4f} (lm-eval)"))
    for key, name in (("checkpoint", "checkpoint"), ("hf_dir", "hf"),
                      ("adapter_dir", "adapter"), ("metrics", "metrics")):
        if s.get(key):
            rows.append((name, s[key]))
    width = max(len(name) for name, _ in rows)
    return ["", "summary"] + [f"  {name:<{width}}  {value}" for name, value in rows]


def _memory(s: dict) -> str:
    text = f"{s['peak_mem_gib']:.2f} GiB"
    if s.get("peak_reserved_gib") is not None:
        text += f" allocated, {s['peak_reserved_gib']:.2f} GiB reserved"
    return text + " (rank 0)"


def _rate(value) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def _loss(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
