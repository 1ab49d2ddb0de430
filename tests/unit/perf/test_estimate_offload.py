"""train.activation_offload in the estimate: the blocks' saved tensors of at least
MIN_OFFLOAD_BYTES leave the device for pinned host memory, except the two blocks in
flight (one computing, one being copied), and appear as host memory."""
import pytest

from lmforge.config import load_config
from lmforge.parallel.offload import MIN_OFFLOAD_BYTES
from lmforge.perf.activations import offloaded_per_layer
from lmforge.perf.estimate import estimate_memory, format_table
from lmforge.perf.estimate_setup import setup_from_config


def _setup(*overrides):
    cfg = load_config(None, ["model.preset=llama2-7b", "model.vocab_size=32000",
                             "data.seq_len=4096", "data.micro_batch_size=2", *overrides])
    return setup_from_config(cfg, device="cuda")


@pytest.mark.parametrize("ckpt", ["full", "none", "selective"])
def test_offload_moves_all_but_two_blocks_to_the_host_and_off_the_device(ckpt):
    base = _setup(f"train.activation_checkpointing={ckpt}")
    offloaded = _setup(f"train.activation_checkpointing={ckpt}", "train.activation_offload=true")
    before, after = estimate_memory(base), estimate_memory(offloaded)
    tokens = base.micro_batch * base.batch.seq_len
    # a checkpointed block's input, every large saved tensor of another
    moved = {c: offloaded_per_layer(offloaded, after.activations, c) * tokens
             for c in (True, False)}
    assert 0 < moved[True] < moved[False]
    blocks = range(base.args.n_layers - 2)
    assert after.host_bytes == pytest.approx(
        sum(moved[offloaded.checkpointed(i)] for i in blocks))
    if ckpt == "selective":  # blocks 0, 2, 4, ... keep their input: half of them here
        assert after.host_bytes == pytest.approx(len(blocks) / 2 * sum(moved.values()))
    assert before.host_bytes == 0
    # the forward end holds every block's activations: exactly the host's share is gone
    assert before.phases["forward end"] - after.phases["forward end"] == pytest.approx(
        after.host_bytes, rel=1e-9)
    assert "host (pinned): offloaded activations" in format_table(after)


def test_tensors_below_the_offload_threshold_stay_on_the_device():
    setup = _setup("data.seq_len=16", "data.micro_batch_size=1",
                   "train.activation_checkpointing=full", "train.activation_offload=true")
    block_input = estimate_memory(setup).activations.layer_input * 16
    assert block_input < MIN_OFFLOAD_BYTES
    assert estimate_memory(setup).host_bytes == 0
