"""Activation checkpointing changes memory, not names or numbers."""
import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.config import load_config
from lmforge.models.llama import build_llama, materialize
from lmforge.parallel.mesh import ParallelDims
from lmforge.parallel.parallelize import apply_model_parallel
from lmforge.train.step import accumulate_gradients

ARGS = tiny_llama_args(n_layers=4, vocab_size=67)


def _model(mode):
    torch.manual_seed(0)
    model = materialize(build_llama(ARGS), "cpu")
    apply_model_parallel(model, ParallelDims(),
                         load_config(None, [f"train.activation_checkpointing={mode}"]))
    return model


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_keeps_parameter_names_and_gradients(mode):
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 67, (2, 16), generator=g),
             "labels": torch.randint(0, 67, (2, 16), generator=g)}
    plain, wrapped = _model("none"), _model(mode)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    loss_a = accumulate_gradients(plain, [batch], torch.device("cpu"))
    loss_b = accumulate_gradients(wrapped, [batch], torch.device("cpu"))
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m: f"{name}: {m}")


def test_compile_per_block_keeps_parameter_names():
    compiled = _model("none")
    apply_model_parallel(compiled, ParallelDims(), load_config(None, ["train.compile=true"]))
    assert list(compiled.state_dict()) == list(_model("none").state_dict())
