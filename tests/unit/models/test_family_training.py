"""The training wraps apply to every family from outside, unchanged: activation
checkpointing, the chunked loss (GPT-J's head has a bias) and QLoRA on the family's own
projections (GPT-J's fc_in/fc_out with biases) give what the plain model gives."""
import pytest
import torch

from helpers.tiny_models import tiny_family_args
from lmforge.config import LoraConfig, OptimConfig, load_config
from lmforge.models.common import materialize
from lmforge.models.loss import IGNORE_INDEX
from lmforge.models.registry import build_model, family_of
from lmforge.parallel.mesh import ParallelDims
from lmforge.parallel.parallelize import apply_model_parallel
from lmforge.peft import after_materialize, is_quantized, prepare_model_for_lora
from lmforge.train.optim import build_optimizer
from lmforge.train.step import accumulate_gradients

FAMILIES = tiny_family_args()
CPU = torch.device("cpu")


def _model(args, seed=0):
    torch.manual_seed(seed)
    return materialize(build_model(args), "cpu")


def _batches(vocab: int, n=2, rows=2, seq=20):
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(n):
        labels = torch.randint(0, vocab, (rows, seq), generator=g)
        labels[0, :4] = IGNORE_INDEX  # a masked prompt
        batches.append({"input_ids": torch.randint(0, vocab, (rows, seq), generator=g),
                        "labels": labels})
    return batches


def _assert_same_gradients(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_activation_checkpointing_keeps_names_loss_and_gradients(family):
    args, batches = FAMILIES[family], _batches(FAMILIES[family].vocab_size)
    plain, wrapped = _model(args), _model(args)
    apply_model_parallel(wrapped, ParallelDims(),
                         load_config(None, ["train.activation_checkpointing=full"]))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    ref = accumulate_gradients(plain, batches, CPU)
    torch.testing.assert_close(accumulate_gradients(wrapped, batches, CPU), ref)
    _assert_same_gradients(wrapped, plain)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_loss_gives_the_same_loss_and_gradients(family):
    args, batches = FAMILIES[family], _batches(FAMILIES[family].vocab_size)
    plain, chunked = _model(args), _model(args)
    ref = accumulate_gradients(plain, batches, CPU)
    loss = accumulate_gradients(chunked, batches, CPU, loss_chunk_tokens=7)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    _assert_same_gradients(chunked, plain)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_qlora_quantizes_the_familys_projections_and_trains_only_the_adapters(family):
    args = FAMILIES[family]
    cfg = LoraConfig(enabled=True, rank=8, alpha=16.0, targets="all-linear", quantize="nf4")
    model = build_model(args)
    prepare_model_for_lora(model, cfg)
    torch.manual_seed(0)
    materialize(model, "cpu")
    after_materialize(model, cfg)
    assert is_quantized(model)
    quantized = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                 if getattr(m, "quantized", None) is not None}
    assert quantized == set(family_of(args).projections.all)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0))
    batches = _batches(args.vocab_size, n=1, rows=4, seq=24)
    batches[0]["labels"] = batches[0]["input_ids"]  # a copy task: learnable in a few steps
    losses = []
    for _ in range(12):
        losses.append(accumulate_gradients(model, batches, CPU).item())
        assert all(p.grad is None for n, p in model.named_parameters()
                   if not n.endswith(("lora_a", "lora_b")))
        optimizer.step()
        optimizer.zero_grad()
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.95 * losses[0], losses
