"""The trainer's one step (``loop.train_step``), in one process: what it reports, and the
non-finite policy (skip: weights untouched, the LR schedule moves on; stop: an error)."""
import pytest
import torch

from helpers import family_training as ft
from lmforge.models.loss import IGNORE_INDEX
from lmforge.parallel.mesh import ParallelDims
from lmforge.train.loop import train_step
from lmforge.job import resolve
from lmforge.train.model_setup import build_train_model
from lmforge.train.optim import Optimizers
from lmforge.train.step import NonFiniteError

ARGS = ft.FAMILIES["qwen2"]


def _trainer(**fields):
    cfg = ft.job_config({"optim.warmup_steps": 2, **fields}, world_size=1)
    torch.manual_seed(0)
    model = build_train_model(resolve(cfg, args=ARGS), torch.device("cpu"))
    return cfg, model, Optimizers(model.parts, cfg.optim, cfg.train.max_steps)


def _micro_batches(cfg) -> list[dict]:
    return ft.rank_micro_batches(ft.step_samples(ARGS.vocab_size)[0], cfg, ParallelDims())


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _poison(model) -> None:
    """The step's loss and gradients become NaN, as bad data would make them."""
    forward_backward = model.forward_backward

    def poisoned(*args, **kwargs):
        loss = forward_backward(*args, **kwargs)
        for p in model.parameters():
            p.grad.fill_(float("nan"))
        return torch.full_like(loss, float("nan"))

    model.forward_backward = poisoned


def test_a_step_reports_its_loss_norm_tokens_and_lr_and_updates():
    cfg, model, optimizers = _trainer()
    micro_batches = _micro_batches(cfg)
    before = _weights(model)
    result = train_step(cfg, ft.runtime(ParallelDims()), model, optimizers, micro_batches, 1)
    assert result.finite
    valid = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches)
    assert result.n_valid == valid
    assert result.loss == result.local_loss and 4 < float(result.loss) < 5  # ~ ln(97)
    assert float(result.grad_norm) > cfg.optim.grad_clip  # the norm before clipping
    assert result.lr == pytest.approx(cfg.optim.lr / 2)  # the first warmup step's
    assert optimizers.lr == pytest.approx(cfg.optim.lr)  # the schedule moved on
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert all(p.grad is None for p in model.parameters())


def test_under_skip_a_nonfinite_step_leaves_the_weights_and_says_where(capsys):
    cfg, model, optimizers = _trainer(**{"train.on_nonfinite": "skip"})
    before = _weights(model)
    _poison(model)
    result = train_step(cfg, ft.runtime(ParallelDims()), model, optimizers,
                        _micro_batches(cfg), 3)
    assert not result.finite
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert optimizers.lr == pytest.approx(cfg.optim.lr)  # the schedule moved on
    err = capsys.readouterr().err
    assert "rank 0: step 3: non-finite loss nan on samples [" in err
    assert "step 3: non-finite loss (nan) or grad norm (nan); update skipped " \
           "(train.on_nonfinite=skip)" in err


def test_under_stop_a_nonfinite_step_raises():
    cfg, model, optimizers = _trainer(**{"train.on_nonfinite": "stop"})
    _poison(model)
    with pytest.raises(NonFiniteError, match=r"step 2: .*stopped without saving "
                                             r"\(train.on_nonfinite=stop\)"):
        train_step(cfg, ft.runtime(ParallelDims()), model, optimizers, _micro_batches(cfg), 2)


def test_with_the_update_in_backward_there_is_no_norm():
    cfg, model, optimizers = _trainer(**{"optim.in_backward": True, "optim.grad_clip": 0.0,
                                         "data.global_batch_size": 2})
    before = _weights(model)
    result = train_step(cfg, ft.runtime(ParallelDims()), model, optimizers,
                        _micro_batches(cfg)[:1], 1)  # no accumulation
    assert result.grad_norm is None and result.finite
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(model)))
