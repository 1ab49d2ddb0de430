"""train.activation_offload: what the transformer blocks save for backward is copied out
and brought back bit for bit (losses and gradients identical), with and without activation
checkpointing; weights, small tensors, the head and the loss stay. On the CPU the hooks
run their real copy path (to a separate host buffer and back), only without streams."""
import contextlib

import pytest
import torch
from torch import nn

from helpers.tiny_models import tiny_llama_args
from lmforge.config import ConfigError, JobConfig, apply_override
from lmforge.parallel import offload
from lmforge.job import resolve
from lmforge.train.model_setup import build_train_model
from lmforge.parallel.offload import ActivationOffloader

ARGS = tiny_llama_args(n_layers=3, vocab_size=97)
CPU = torch.device("cpu")
SEQ, ROWS, MICRO_BATCHES = 32, 2, 2
BLOCK_INPUT_BYTES = ROWS * SEQ * ARGS.dim * 4  # 8 KiB, fp32
# Between the block input and the per-token norm statistics (ROWS x SEQ x 4 bytes): the
# real 1 MiB would keep everything of a model this small.
THRESHOLD = 4096


@pytest.fixture(autouse=True)
def _tiny_threshold(monkeypatch):
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", THRESHOLD)


def _micro_batches():
    """With positions and a (causal) mask, as packed SFT gives: inputs of every block."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ARGS.vocab_size, (MICRO_BATCHES, ROWS, SEQ + 1), generator=g)
    positions = torch.arange(SEQ).expand(ROWS, SEQ)
    mask = torch.ones(ROWS, 1, SEQ, SEQ, dtype=torch.bool).tril()
    return [{"input_ids": i[:, :-1], "labels": i[:, 1:], "positions": positions,
             "mask": mask} for i in ids]


def _step(checkpointing: str, activation_offload: bool):
    cfg = JobConfig()
    cfg.train.device, cfg.train.activation_checkpointing = "cpu", checkpointing
    cfg.data.seq_len = SEQ
    cfg.train.activation_offload = activation_offload
    torch.manual_seed(0)
    model = build_train_model(resolve(cfg, args=ARGS), CPU)
    batches = _micro_batches()
    n_valid = sum(int(b["labels"].numel()) for b in batches)
    loss = model.forward_backward(batches, n_valid, CPU, contextlib.nullcontext)
    return loss, [p.grad for p in model.parameters()], model.offload


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_offload_leaves_the_loss_and_every_gradient_bit_identical(checkpointing):
    loss, grads, _ = _step(checkpointing, activation_offload=False)
    offloaded_loss, offloaded_grads, offloader = _step(checkpointing, activation_offload=True)
    assert offloader.stats.offloaded > 0  # the hooks ran, not a no-op
    assert torch.equal(offloaded_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(offloaded_grads, grads, strict=True))


def test_with_full_checkpointing_exactly_the_block_inputs_go_out_and_are_prefetched():
    stats = _step("full", activation_offload=True)[2].stats
    blocks = ARGS.n_layers * MICRO_BATCHES
    # only the checkpoints' inputs: not the recomputation's tensors, nor the head's or the
    # loss's, nor a weight
    assert (stats.offloaded, stats.offloaded_bytes) == (blocks, blocks * BLOCK_INPUT_BYTES)
    assert stats.kept_weights == stats.shared == 0
    assert stats.kept_shared == 2 * blocks  # positions and mask, read by every block
    # backward's first block (the last) waits for its copy; every other one was started
    # while the block after it ran its backward
    assert (stats.fetched, stats.prefetched) == (MICRO_BATCHES, blocks - MICRO_BATCHES)


def test_without_checkpointing_weights_and_small_tensors_stay_on_the_device():
    stats = _step("none", activation_offload=True)[2].stats
    assert stats.offloaded > ARGS.n_layers * MICRO_BATCHES and stats.offloaded_bytes > 0
    assert stats.kept_weights > 0 and stats.kept_small > 0
    assert stats.shared > 0  # q, k, v read one normed input: copied once
    assert stats.fetched + stats.prefetched == stats.offloaded


def test_pack_copies_to_separate_memory_and_unpack_restores_values_and_strides():
    offloader = ActivationOffloader(CPU, min_bytes=THRESHOLD)
    layer = nn.Linear(64, 64)
    with offloader.block(layer, follows_previous=False):
        activation = torch.randn(64, 32).t()  # dense, not contiguous
        packed = offloader.pack(activation)
        reshaped = offloader.pack(activation.view(2, 16, 64).transpose(0, 1))
    handle, size, stride = packed
    assert handle.host.untyped_storage().data_ptr() != activation.untyped_storage().data_ptr()
    assert reshaped[0] is handle and offloader.stats.shared == 1  # a view of the same memory
    back = offloader.unpack(packed)
    assert torch.equal(back, activation) and back.stride() == activation.stride()
    assert back.untyped_storage().data_ptr() not in (
        activation.untyped_storage().data_ptr(), handle.host.untyped_storage().data_ptr())
    again = offloader.unpack(reshaped)
    assert torch.equal(again, activation.view(2, 16, 64).transpose(0, 1))


def test_weights_shared_inputs_small_and_expanded_tensors_are_kept_as_they_are():
    offloader = ActivationOffloader(CPU, min_bytes=THRESHOLD)
    layer = nn.Linear(64, 64)
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()  # 4 KiB, given to every block
    with offloader.block(layer, follows_previous=False, shared_inputs=(mask,)):
        kept = {"weight": layer.weight, "weight view": layer.weight.t(),
                "cast weight": layer.weight.to(torch.float64),  # as autocast's bf16 copy
                "mask": mask, "small": torch.randn(8, 8),
                "expanded": torch.randn(1, 64).expand(64, 64)}
        for name, tensor in kept.items():
            assert offloader.pack(tensor) is tensor, name
    s = offloader.stats
    assert (s.kept_weights, s.kept_shared, s.kept_small, s.kept_other) == (3, 1, 1, 1)
    assert s.offloaded == 0


def test_a_value_that_is_not_a_boolean_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^train\.activation_offload: expected true or false"):
        apply_override(JobConfig(), "train.activation_offload=sometimes")
