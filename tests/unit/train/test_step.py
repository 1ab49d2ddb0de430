"""The step loss is sum of token losses / valid tokens of the whole step, whatever the split."""
import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.models.llama import build_llama, materialize
from lmforge.train.optim import lr_multiplier
from lmforge.config import OptimConfig
from lmforge.eval.evaluate import evaluate
from lmforge.models.loss import IGNORE_INDEX
from lmforge.parallel.mesh import ParallelDims
from lmforge.train.step import accumulate_gradients, normalize_loss, step_counts

ARGS = tiny_llama_args(vocab_size=61)


def _model():
    torch.manual_seed(0)
    return materialize(build_llama(ARGS), "cpu")


def _padded_batch(lengths, seq=12):
    """Variable-length rows, right-padded with label -100."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ARGS.vocab_size, (len(lengths), seq), generator=g)
    labels = torch.randint(0, ARGS.vocab_size, (len(lengths), seq), generator=g)
    for row, n in enumerate(lengths):
        labels[row, n:] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_accumulation_split_does_not_change_loss_or_gradients():
    lengths = [12, 3, 7, 1]
    whole = _padded_batch(lengths)
    model = _model()
    loss_one = accumulate_gradients(model, [whole], torch.device("cpu"))
    grads_one = _grads(model)

    model.zero_grad()
    singles = [{k: v[i:i + 1] for k, v in whole.items()} for i in range(len(lengths))]
    loss_acc = accumulate_gradients(model, singles, torch.device("cpu"))
    grads_acc = _grads(model)

    assert loss_acc.item() == pytest.approx(loss_one.item(), rel=1e-6)
    for name in grads_one:
        torch.testing.assert_close(grads_acc[name], grads_one[name], rtol=1e-5, atol=1e-7)


def test_loss_is_not_a_mean_of_micro_batch_means():
    whole = _padded_batch([12, 1])
    model = _model()
    singles = [{k: v[i:i + 1] for k, v in whole.items()} for i in range(2)]
    step_loss = accumulate_gradients(model, singles, torch.device("cpu")).item()
    mean_of_means = sum(evaluate(model, [b], torch.device("cpu"))[0] for b in singles) / 2
    token_mean, tokens = evaluate(model, [whole], torch.device("cpu"))
    assert tokens == 13
    assert step_loss == pytest.approx(token_mean, rel=1e-6)
    assert abs(step_loss - mean_of_means) > 1e-4  # the two definitions differ here


def test_all_padding_step_gives_zero_loss_not_nan():
    batch = _padded_batch([0, 0])
    loss = accumulate_gradients(_model(), [batch], torch.device("cpu"))
    assert loss.item() == 0.0


def test_normalize_loss_is_sum_times_dp_over_global_valid_tokens():
    loss_sum = torch.tensor(12.0)
    assert normalize_loss(loss_sum, 4).item() == 3.0
    assert normalize_loss(loss_sum, 4, dp=2).item() == 6.0  # undoes FSDP's dp-average
    assert normalize_loss(loss_sum, 0).item() == 12.0  # no valid tokens: divide by 1


def test_data_parallel_factor_scales_gradients_not_the_returned_loss():
    batch = _padded_batch([12, 5])
    model = _model()
    loss_one = accumulate_gradients(model, [batch], torch.device("cpu"))
    grads_one = _grads(model)
    model.zero_grad()
    loss_dp = accumulate_gradients(model, [batch], torch.device("cpu"), dp=4)
    assert loss_dp.item() == loss_one.item()
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, 4 * grads_one[name])


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = OptimConfig(warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_multiplier(0, cfg, 100) == pytest.approx(0.1)
    assert lr_multiplier(9, cfg, 100) == pytest.approx(1.0)
    assert lr_multiplier(10, cfg, 100) == pytest.approx(1.0)
    assert lr_multiplier(100, cfg, 100) == pytest.approx(0.1)
    linear = OptimConfig(warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert lr_multiplier(50, linear, 100) == pytest.approx(0.5)


def test_step_counts_sum_the_positions_and_flops_of_micro_batches_of_any_length():
    """SFT micro-batches are as long as their longest sample: positions are rows x length
    of each, and FLOPs per token follow the length (attention)."""
    batches = [_padded_batch([12, 3], seq=12), _padded_batch([5, 2, 1], seq=6)]
    counts = step_counts(batches, ParallelDims(), torch.device("cpu"), lambda s: 100.0 + s)
    assert counts.valid == 12 + 3 + 5 + 2 + 1
    assert counts.positions == 2 * 12 + 3 * 6
    assert counts.flops == 2 * 12 * 112.0 + 3 * 6 * 106.0
    assert step_counts(batches, ParallelDims(), torch.device("cpu")).flops == 0
