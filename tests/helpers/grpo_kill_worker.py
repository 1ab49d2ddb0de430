"""`lmforge` for the GRPO kill -9 test (tests/integration/test_grpo_resume.py): it records
every completion the rollout samples and, when told, kills itself (SIGKILL, as kill -9)
at one point of one step.

  LMFORGE_TEST_COMPLETIONS=FILE   each rollout call appends one JSON line to FILE: the
                                  step, the prompts' stream indices, and each completion's
                                  token ids, finish reason and sampling log-probabilities
  LMFORGE_TEST_KILL=WHERE:STEP:N  where to die, in step STEP:
      rollout   at the N-th token the decoder samples in the step's rollout (or, when the
                step's completions end sooner, as its rollout returns)
      update    right after the step's optimizer update, before its checkpoint
      save      while DCP writes the step's checkpoint (step-N.tmp half written)

Each is a process dying where a real one could: between two tokens, between a step and
its checkpoint, in the middle of a checkpoint's files.
"""
import json
import os
import signal
import sys


def _die(what: str) -> None:
    print(f"killing itself (SIGKILL) {what}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def record_completions(path: str) -> None:
    from lmforge.train import grpo

    original = grpo.GRPO._generate

    def recording(self, model, prompts, step, *args, **kwargs):
        rows = original(self, model, prompts, step, *args, **kwargs)
        line = {"step": step, "sample_ids": prompts["sample_ids"].tolist(),
                "ids": [c.ids for c in rows], "finish": [c.finish_reason for c in rows],
                "sampling_logprobs": [c.sampling_logprobs for c in rows]}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return rows

    grpo.GRPO._generate = recording


def kill_in_rollout(step: int, token: int) -> None:
    from lmforge.models import generate
    from lmforge.train import grpo

    state = {"step": None, "tokens": 0}
    sample, prepare = generate.sample, grpo.GRPO.prepare

    def counting_sample(*args, **kwargs):
        if state["step"] == step:
            state["tokens"] += 1
            if state["tokens"] == token:
                _die(f"in step {step}'s rollout, at its token {token}")
        return sample(*args, **kwargs)

    def watched_prepare(self, tm, micro_batches, at, *args, **kwargs):
        state["step"] = at
        out = prepare(self, tm, micro_batches, at, *args, **kwargs)
        if at == step:
            _die(f"as step {step}'s rollout returns ({state['tokens']} tokens sampled)")
        return out

    generate.sample, grpo.GRPO.prepare = counting_sample, watched_prepare


def kill_after_update(step: int) -> None:
    from lmforge.train import loop

    original = loop.train_step

    def dying_step(cfg, rt, model, optimizers, micro_batches, at, *args, **kwargs):
        result = original(cfg, rt, model, optimizers, micro_batches, at, *args, **kwargs)
        if at == step:
            _die(f"after step {step}'s update")
        return result

    loop.train_step = dying_step


def kill_in_save(step: int) -> None:
    from pathlib import Path

    from lmforge.checkpoint import state

    original = state.dcp_writer

    def dying_writer(tmp):
        writer = original(tmp)
        if Path(tmp).name.startswith(f"step-{step:07d}"):
            def dying_write(*args, **kwargs):
                _die(f"while writing checkpoint {Path(tmp).name}")
            writer.write_data = dying_write
        return writer

    state.dcp_writer = dying_writer


def install() -> None:
    if os.environ.get("LMFORGE_TEST_COMPLETIONS"):
        record_completions(os.environ["LMFORGE_TEST_COMPLETIONS"])
    kill = os.environ.get("LMFORGE_TEST_KILL")
    if not kill:
        return
    where, step, n = kill.split(":")
    if where == "rollout":
        kill_in_rollout(int(step), int(n))
    elif where == "update":
        kill_after_update(int(step))
    elif where == "save":
        kill_in_save(int(step))
    else:
        raise SystemExit(f"LMFORGE_TEST_KILL: unknown point {where!r}")


if __name__ == "__main__":
    install()
    from lmforge.cli import main

    sys.exit(main(sys.argv[1:]))
