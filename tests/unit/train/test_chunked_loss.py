"""train.loss_chunk_tokens: the same loss and gradients, without the micro-batch's logits."""
import functools

import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.config import ConfigError, JobConfig, validate
from lmforge.perf.tracker import TensorMemoryTracker
from lmforge.models.llama import LlamaArgs, build_llama, materialize
from lmforge.eval.evaluate import evaluate
from lmforge.models.loss import IGNORE_INDEX
from lmforge.train.step import accumulate_gradients

ARGS = tiny_llama_args(vocab_size=97)
CPU = torch.device("cpu")


def _model(tie: bool = False):
    torch.manual_seed(0)
    args = LlamaArgs(**{**ARGS.__dict__, "tie_embeddings": tie})
    return materialize(build_llama(args), "cpu")


def _batches(vocab: int, rows=3, seq=20, n=2):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        labels = torch.randint(0, vocab, (rows, seq), generator=g)
        labels[0, 5:] = IGNORE_INDEX  # padding, and a chunk with no valid token
        labels[1, :3] = IGNORE_INDEX  # a masked prompt
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [7, 16, 60, 1000])  # uneven, even, whole, larger
def test_chunked_loss_gives_the_same_loss_and_gradients(tie, chunk):
    batches = _batches(ARGS.vocab_size)
    reference = _model(tie)
    ref_loss = accumulate_gradients(reference, batches, CPU)
    model = _model(tie)
    loss = accumulate_gradients(model, batches, CPU, loss_chunk_tokens=chunk)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_evaluation_gives_the_same_loss():
    batches = _batches(ARGS.vocab_size)
    model = _model()
    assert evaluate(model, batches, CPU, loss_chunk_tokens=9) == pytest.approx(
        evaluate(model, batches, CPU), rel=1e-6)


def test_chunked_loss_under_bf16_autocast_matches_closely():
    batches = _batches(ARGS.vocab_size)
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    ref_loss = accumulate_gradients(_model(), batches, CPU, autocast)
    loss = accumulate_gradients(_model(), batches, CPU, autocast, loss_chunk_tokens=16)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=0)


def _peak_bytes(vocab: int, chunk: int) -> int:
    torch.manual_seed(0)
    args = LlamaArgs(**{**ARGS.__dict__, "vocab_size": vocab})
    model = materialize(build_llama(args), "cpu")
    batch = _batches(vocab, rows=4, seq=64, n=1)
    tracker = TensorMemoryTracker()
    tracker.track(list(model.parameters()) + [batch[0]["input_ids"], batch[0]["labels"]])
    with tracker:
        accumulate_gradients(model, batch, CPU, loss_chunk_tokens=chunk)
    return tracker.peak


def test_chunking_removes_the_micro_batch_logits_from_the_peak():
    # 256 tokens x 8,000 logits: fp32 logits, their log-softmax and its gradient are
    # 7.8 MiB each for the whole micro-batch, and 32x smaller per 8-token chunk
    vocab, tokens = 8000, 4 * 64
    whole, chunked = _peak_bytes(vocab, 0), _peak_bytes(vocab, 8)
    logits_fp32 = 4 * tokens * vocab
    assert whole - chunked > 2 * logits_fp32
    weights_and_grads = 2 * 4 * 2 * vocab * ARGS.dim  # embedding + head, and their grads
    assert chunked < weights_and_grads + logits_fp32


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"])
def test_chunked_loss_is_refused_with_tensor_or_pipeline_parallelism(layout):
    cfg = JobConfig()
    cfg.train.loss_chunk_tokens = 1024
    section, value = layout.split("=")
    setattr(cfg.parallel, section.split(".")[1], int(value))
    cfg.model.n_layers, cfg.model.tie_embeddings = 4, False
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens"):
        validate(cfg, world_size=2)


def test_negative_chunk_is_refused():
    cfg = JobConfig()
    cfg.train.loss_chunk_tokens = -1
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens"):
        validate(cfg)
