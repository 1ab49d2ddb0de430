"""`lmforge` with one fault injected, chosen by LMFORGE_TEST_FAULT (tests only):

  nan:RANK:STEP      that rank's loss and gradients become NaN at that step
  inf_grad:RANK:STEP one of that rank's gradients becomes inf at that step (the loss stays
                     finite), as an fp16 overflow would; every rank prints its loss scale
                     after each step ("rank R: step S: loss scale X")
  hang_commit:STEP   the checkpoint of that step stalls just before its commit (after
                     every data file is written), touching LMFORGE_TEST_SIGNAL first
  await_stop:STEP    after that step the last rank writes its pid to LMFORGE_TEST_SIGNAL
                     and waits (up to 5 minutes) for a stop signal, which the test sends;
                     every other rank ignores SIGUSR1, so it can stop only because the
                     stop decision is collective
  die:RANK:STEP      that rank kills itself (SIGKILL, as kill -9) after that step's
                     update, in the first attempt of a torchrun job only
  die_saving:RANK:STEP that rank kills itself while writing that step's checkpoint (in
                     the background thread of train.async_checkpoint), first attempt only
"""
import os
import sys
import time

import torch

fault = os.environ.get("LMFORGE_TEST_FAULT", "")
kind, *params = fault.split(":")

if kind == "nan":
    import lmforge.train.model_setup as model_setup

    bad_rank, bad_step = int(params[0]), int(params[1])
    original = model_setup.accumulate_gradients
    calls = {"n": 0}

    def poisoned(model, *args, **kwargs):
        loss = original(model, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == bad_step and int(os.environ.get("RANK", 0)) == bad_rank:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            return torch.full_like(loss, float("nan"))
        return loss

    model_setup.accumulate_gradients = poisoned

elif kind == "inf_grad":
    from lmforge.train.precision import LossScaler

    bad_rank, bad_step = int(params[0]), int(params[1])
    rank = int(os.environ.get("RANK", 0))
    unscale, step = LossScaler.unscale, LossScaler.step

    def overflowing_unscale(self, optimizers):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == bad_step and rank == bad_rank:
            grad = next(p.grad for o in optimizers for g in o.param_groups
                        for p in g["params"] if p.grad is not None)
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # (a shard)
            local.fill_(float("inf"))
        unscale(self, optimizers)

    def reporting_step(self, optimizers, step_number, update=True):
        step(self, optimizers, step_number, update)
        print(f"rank {rank}: step {step_number}: loss scale {self.scale:g}", flush=True)

    LossScaler.unscale, LossScaler.step = overflowing_unscale, reporting_step

elif kind == "hang_commit":
    from lmforge.checkpoint import directory

    hang_step = int(params[0])
    original_commit = directory.commit

    def stalled_commit(tmp, final):
        if directory.checkpoint_step(final) == hang_step:
            open(os.environ["LMFORGE_TEST_SIGNAL"], "w").close()
            time.sleep(600)
        return original_commit(tmp, final)

    directory.commit = stalled_commit

elif kind == "await_stop":
    import signal

    from lmforge.train.preempt import StopSignals

    await_step = int(params[0])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    should_stop = StopSignals.should_stop

    def awaiting_should_stop(self, step):
        if rank != world - 1:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        elif step == await_step:
            with open(os.environ["LMFORGE_TEST_SIGNAL"] + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(os.environ["LMFORGE_TEST_SIGNAL"] + ".tmp",
                      os.environ["LMFORGE_TEST_SIGNAL"])
            deadline = time.time() + 300
            while self.received is None and time.time() < deadline:
                time.sleep(0.01)
        return should_stop(self, step)

    StopSignals.should_stop = awaiting_should_stop

elif kind in ("die", "die_saving") and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                      "0") == "0":
    import signal

    bad_rank, bad_step = int(params[0]), int(params[1])
    mine = int(os.environ.get("RANK", 0)) == bad_rank

    def die(what: str) -> None:
        print(f"rank {bad_rank}: killing itself (SIGKILL) {what}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if kind == "die":
        from lmforge.train import loop

        original_step = loop.train_step

        def dying_step(cfg, rt, model, optimizers, micro_batches, step, *args, **kwargs):
            result = original_step(cfg, rt, model, optimizers, micro_batches, step,
                                   *args, **kwargs)
            if mine and step == bad_step:
                die(f"after step {step}")
            return result

        loop.train_step = dying_step
    else:
        from pathlib import Path

        from lmforge.checkpoint import async_writer

        original_writer = async_writer.dcp_writer

        def dying_writer(tmp):
            writer = original_writer(tmp)
            if mine and Path(tmp).name.startswith(f"step-{bad_step:07d}"):
                write_data = writer.write_data

                def dying_write(*args, **kwargs):
                    die(f"while writing checkpoint {tmp.name}")
                    return write_data(*args, **kwargs)

                writer.write_data = dying_write
            return writer

        async_writer.dcp_writer = dying_writer

if __name__ == "__main__":
    from lmforge.cli import main

    sys.exit(main(sys.argv[1:]))
