"""train.dtype=fp16: autocast with fp32 master weights and a dynamic loss scale. Runs of
the trainer in this process (tiny model, CPU, where autocast computes matmuls in fp16 as
on a GPU): the loss curve follows fp32's, an overflowing step is skipped, and resume
continues the scale exactly."""
import copy

import pytest
import torch

from helpers.runs import read_metrics, tiny_corpus, tiny_overrides  # noqa: F401 (fixture)
from lmforge.config import ConfigError, load_config
from lmforge.train import precision
from lmforge.train.loop import train
from lmforge.train.precision import LossScaler


@pytest.fixture(autouse=True)
def _threads_restored():
    """The runs below take one thread (``train.threads=1``: a tiny model is fastest so,
    beside other processes too); the other tests get the count they had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _train(out, corpus, steps, *extra):
    cfg = load_config(None, [*tiny_overrides(corpus, steps), f"train.output_dir={out}",
                             "train.device=cpu", "train.threads=1", "train.save=false",
                             "train.progress_bar=false", *extra])
    train(cfg)
    return read_metrics(out)


def test_fp16_tracks_the_fp32_loss_curve(tiny_corpus, tmp_path):
    # 4 micro-batches per step (accumulated under one scale) and clipping at 0.5.
    fp32 = [r["loss"] for r in _train(tmp_path / "fp32", tiny_corpus, 8, "train.dtype=fp32")]
    records = _train(tmp_path / "fp16", tiny_corpus, 8, "train.dtype=fp16")
    fp16 = [r["loss"] for r in records]
    assert fp16 != fp32  # the matmuls did run in fp16
    # fp16 keeps 11 significant bits (a relative rounding of 2^-11 ~ 5e-4 per matmul
    # output); at this high LR the two trajectories drift apart by a few 1e-3 over 8
    # steps (0.4% at most here), while the loss falls by a quarter: 1% tells tracking
    # from a broken run.
    assert fp16 == pytest.approx(fp32, rel=1e-2)
    assert fp16[-1] < 0.85 * fp16[0]
    assert all(r["loss_scale"] == 65536 and r["skipped_steps"] == 0 for r in records)


def _state(optimizers: list) -> tuple[list, list]:
    """Copies of the parameters and of the optimizer state the optimizers hold."""
    params = [p.detach().clone() for o in optimizers for g in o.param_groups
              for p in g["params"]]
    return params, [copy.deepcopy(o.state_dict()["state"]) for o in optimizers]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_an_overflowing_step_is_skipped_and_the_scale_backs_off(tiny_corpus, tmp_path,
                                                                monkeypatch, capsys):
    """Step 3's gradient turns inf in the real loop: its update is skipped (weights and
    AdamW state as they were), the scale halves, skipped_steps counts it, training goes
    on, and two good steps later (growth interval 2) the scale doubles again."""
    unscale, step = LossScaler.unscale, LossScaler.step
    seen = {}

    def overflowing_unscale(self, optimizers):
        if len(seen) == 2:  # step 3
            next(p for g in optimizers[0].param_groups for p in g["params"]).grad[0] = \
                float("inf")
        unscale(self, optimizers)

    def recorded_step(self, optimizers, step_number, update=True):
        before = _state(optimizers)
        step(self, optimizers, step_number, update)
        seen[step_number] = _equal(before, _state(optimizers))

    monkeypatch.setattr(LossScaler, "unscale", overflowing_unscale)
    monkeypatch.setattr(LossScaler, "step", recorded_step)
    monkeypatch.setattr(precision, "GROWTH_INTERVAL", 2)
    records = _train(tmp_path / "run", tiny_corpus, 6, "train.dtype=fp16")
    assert seen == {1: False, 2: False, 3: True, 4: False, 5: False, 6: False}
    # The scale each step's backward used: grown after steps 2 and 5, halved after 3.
    assert [r["loss_scale"] for r in records] == [2**16, 2**16, 2**17, 2**16, 2**16, 2**17]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert [r["nonfinite_steps"] for r in records] == [0] * 6  # not a non-finite loss
    assert all(r["loss"] < 10 for r in records)
    assert records[2]["grad_norm"] == float("inf")  # the overflow, as measured
    assert ("step 3: fp16 gradients overflowed at loss scale 131072; update skipped, "
            "loss scale now 65536") in capsys.readouterr().err


def test_resume_continues_the_loss_scale_bit_exactly(tiny_corpus, tmp_path, monkeypatch):
    """A first scale of 2^21 overflows step 1's fp16 gradients by itself; the scale then
    grows every 2 good steps. Stopped after step 2 (a skip behind it, half-way to a
    growth) and resumed, the run repeats the uninterrupted one bit for bit."""
    monkeypatch.setattr(precision, "INIT_SCALE", 2.0**21)
    monkeypatch.setattr(precision, "GROWTH_INTERVAL", 2)
    straight = _train(tmp_path / "straight", tiny_corpus, 6, "train.dtype=fp16")
    split = tmp_path / "split"
    _train(split, tiny_corpus, 6, "train.dtype=fp16", "train.stop_at_step=2", "train.save=true")
    resumed = _train(split, tiny_corpus, 6, "train.dtype=fp16", "train.resume=auto")
    assert straight[1]["skipped_steps"] == 1 and straight[2]["loss_scale"] == 2**20
    assert len({r["loss_scale"] for r in straight[2:]}) > 1  # it moves after the resume
    for key in ("loss", "grad_norm", "loss_scale", "skipped_steps"):  # (repr: NaN too)
        assert [repr(r[key]) for r in resumed] == [repr(r[key]) for r in straight], key


@pytest.mark.parametrize("overrides, field", [
    (["optim.in_backward=true"], "optim.in_backward"),
    (["train.param_dtype=bf16", "optim.name=adamw_bf16"], "train.param_dtype"),
])
def test_fp16_refusals_name_the_field(overrides, field):
    cfg = load_config(None, ["train.dtype=fp16", *overrides])
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith(f"{field}: ")
