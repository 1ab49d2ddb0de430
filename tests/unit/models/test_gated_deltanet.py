"""The Gated DeltaNet layer (models/gated_deltanet.py) and its delta rule
(models/delta_rule.py): the rule's two forms against transformers' torch reference, the
whole layer against Qwen3-Next's and Qwen3.5's with weights copied across, packed
documents against each document alone, decoding (prefill, steps, left padding) against
the full forward, and its FLOPs against torch's count. All fp32, to 1e-5."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3NextConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next import modeling_qwen3_next as hf
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from lmforge.models.attention import DecodeMask, DocumentMask
from lmforge.models.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from lmforge.models.gated_deltanet import (
    GatedDeltaNet, GatedDeltaNetArgs, GatedDeltaNetState, forward_flops_per_token,
    from_qwen3_next, l2_normalize, qkv_layout, to_qwen3_next)

# Two value heads per key head, and key and value head dims that differ, so a swapped
# axis or a wrong head pairing shows.
ARGS = GatedDeltaNetArgs(dim=32, linear_key_heads=2, linear_value_heads=4,
                         linear_key_head_dim=8, linear_value_head_dim=6,
                         linear_conv_kernel=4)
CHUNK = 8  # small, so short sequences cross several chunk boundaries
TOLERANCE = 1e-5


def rule_inputs(batch: int, seq: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    """Random q, k (unit norm, as the layer gives them), v, g < 0 and beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k = l2_normalize(rand(batch, seq, heads, dk)), l2_normalize(rand(batch, seq, heads, dk))
    v = rand(batch, seq, heads, dv)
    g = -torch.nn.functional.softplus(rand(batch, seq, heads))  # (some near 0, some large)
    beta = rand(batch, seq, heads).sigmoid()
    return q, k, v, g, beta, rand(batch, heads, dk, dv)


def new_layer(chunk_size: int = CHUNK, seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(ARGS, chunk_size=chunk_size)
    layer.reset_parameters(std=0.3, out_std=0.1)  # (larger than usual: outputs not tiny)
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)  # (ones would hide a missing norm weight)
    return layer


def hf_config(config_class):
    return config_class(
        hidden_size=ARGS.dim, linear_num_key_heads=ARGS.linear_key_heads,
        linear_num_value_heads=ARGS.linear_value_heads,
        linear_key_head_dim=ARGS.linear_key_head_dim,
        linear_value_head_dim=ARGS.linear_value_head_dim,
        linear_conv_kernel_dim=ARGS.linear_conv_kernel, rms_norm_eps=ARGS.norm_eps,
        num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=8)


def hf_state(layer: GatedDeltaNet) -> dict:
    """The layer's tensors in the checkpoints' order: in_proj_qkv's rows and conv1d's
    channels from grouped per key head (memory) back to every q, every k, every v."""
    to_hf = torch.argsort(qkv_layout(ARGS).rows_from_hf())
    return {name: t[to_hf] if name in ("in_proj_qkv.weight", "conv1d.weight") else t
            for name, t in layer.state_dict().items()}


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=TOLERANCE, rtol=0)


# ------------------------------------------------------------------- the rule

@pytest.mark.parametrize("seq", [1, 7, 8, 9, 16, 21])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_equals_transformers_chunked_and_recurrent(seq, with_state):
    q, k, v, g, beta, state = rule_inputs(2, seq)
    initial = state if with_state else None
    ours, ours_state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK,
                                              initial_state=initial)
    for reference in (
            hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK,
                                            initial_state=initial, output_final_state=True),
            hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial,
                                                output_final_state=True)):
        assert_close(ours, reference[0])
        assert_close(ours_state, reference[1])


@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_rule_equals_transformers_recurrent(with_state):
    q, k, v, g, beta, state = rule_inputs(2, 11)
    initial = state if with_state else None
    ours, ours_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial)
    expected, expected_state = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=initial, output_final_state=True)
    assert_close(ours, expected)
    assert_close(ours_state, expected_state)


def test_chunked_rule_restarts_at_each_document_and_gives_the_initial_state_to_the_first():
    # Documents of 5, 3 (ends on a chunk boundary), 8 (one whole chunk), 1 and 4 tokens.
    lengths = [5, 3, 8, 1, 4]
    q, k, v, g, beta, state = rule_inputs(1, sum(lengths))
    segments = torch.repeat_interleave(torch.arange(len(lengths)),
                                       torch.tensor(lengths))[None]
    ours, ours_state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK,
                                              initial_state=state, segments=segments)
    start = 0
    for i, n in enumerate(lengths):
        part = slice(start, start + n)
        alone, alone_state = recurrent_gated_delta_rule(
            q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part],
            initial_state=state if i == 0 else None)
        assert_close(ours[:, part], alone)
        start += n
    assert_close(ours_state, alone_state)  # the last document's


def test_a_document_that_decays_hundreds_of_nats_leaves_the_next_chunk_finite():
    """A chunk's state leaves it decayed from each write to the chunk's end; a write in a
    document that ended inside the chunk is not carried at all, and its decay to the end
    (the next document's small sum minus its own large one: exp(+300)) must not be taken
    (inf * 0 made the state NaN, and every later chunk's outputs: a packed SFT run's loss
    was NaN at step 1)."""
    lengths = [5, 7, 4]  # the second document crosses the first chunk boundary
    q, k, v, g, beta, _ = rule_inputs(1, sum(lengths))
    g[:, :5] = -100.0
    segments = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    ours, ours_state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK,
                                              segments=segments)
    alone, alone_state = recurrent_gated_delta_rule(q[:, 12:], k[:, 12:], v[:, 12:],
                                                    g[:, 12:], beta[:, 12:])
    assert torch.isfinite(ours).all()
    assert_close(ours[:, 12:], alone)
    assert_close(ours_state, alone_state)


def test_the_in_place_step_advances_the_state_it_is_given_as_the_rule_does():
    """The decoder's one-token step updates its state tensor itself (``inplace``)."""
    q, k, v, g, beta, state = rule_inputs(2, 3)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    held = state.clone()
    got, got_state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=held,
                                                inplace=True)
    assert got_state is held
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_state, want_state, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_both_rules_compute_in_fp32_under_autocast(dtype):
    """A bf16 or fp16 run's autocast leaves the rules in fp32: the same results as
    without it (with documents, autocast once made the triangular system bf16, which the
    CPU cannot solve)."""
    q, k, v, g, beta, state = rule_inputs(1, 21)
    segments = torch.repeat_interleave(torch.arange(2), torch.tensor([9, 12]))[None]
    want = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK, segments=segments)
    want_step = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    with torch.autocast("cpu", dtype=dtype):
        got = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK, segments=segments)
        got_step = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    for a, b in zip(got + got_step, want + want_step):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ------------------------------------------------------------------ the layer

def test_layer_equals_transformers_qwen3_next_with_weights_mapped():
    layer = new_layer(chunk_size=64)  # transformers' chunk
    reference = Qwen3NextGatedDeltaNet(hf_config(Qwen3NextConfig), layer_idx=0)
    reference.load_state_dict(to_qwen3_next(hf_state(layer), ARGS))
    x = torch.randn(2, 70, ARGS.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(x)
        scale = want.abs().max()  # (about 4: 1e-5 of it, as rows rounded in another
        # order by the grouped in_proj_qkv differ by up to 1.1e-5)
        torch.testing.assert_close(layer(x), want, atol=TOLERANCE * scale, rtol=0)
        layer.chunk_size = CHUNK  # the chunk is a choice of computation, not of result
        torch.testing.assert_close(layer(x), want, atol=TOLERANCE * scale, rtol=0)


def test_layer_equals_transformers_qwen3_5_by_name():
    layer = new_layer()
    reference = Qwen3_5GatedDeltaNet(hf_config(Qwen3_5TextConfig), layer_idx=0)
    reference.load_state_dict(hf_state(layer))  # the same names, the same shapes
    x = torch.randn(2, 19, ARGS.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(layer(x), reference(x))


def test_qwen3_next_mapping_round_trips_and_keeps_every_prefix():
    ours = {f"layers.3.linear_attn.{name}": t for name, t in new_layer().state_dict().items()}
    theirs = to_qwen3_next(ours, ARGS)
    assert "layers.3.linear_attn.in_proj_qkvz.weight" in theirs
    assert "layers.3.linear_attn.in_proj_ba.weight" in theirs
    back = from_qwen3_next(theirs, ARGS)
    assert back.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name


def test_packed_rows_equal_each_document_alone():
    layer = new_layer()
    # Row 0: documents of 2 (shorter than the convolution's window), 6 (ends on a chunk
    # boundary), 9 and 4; row 1: 13 and 8 (ids need not start at 0, nor be contiguous).
    rows = [[2, 6, 9, 4], [13, 8]]
    ids = [torch.repeat_interleave(torch.arange(len(r)) * 3 + 7, torch.tensor(r))
           for r in rows]
    x = torch.randn(2, 21, ARGS.dim, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = layer(x, mask=DocumentMask(torch.stack(ids)))
        for row, lengths in enumerate(rows):
            start = 0
            for n in lengths:
                alone = layer(x[row:row + 1, start:start + n])
                assert_close(packed[row:row + 1, start:start + n], alone)
                start += n


# ------------------------------------------------------------------ decoding

def test_prefill_then_steps_equal_the_full_forward():
    layer = new_layer()
    x = torch.randn(2, 20, ARGS.dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = layer(x)
        prompt, state = layer.prefill(x[:, :11])
        # Single tokens take the recurrent form; the last three, the chunked one with
        # the state as its start (a multi-token step).
        steps = [layer.step(x[:, t:t + 1], state) for t in range(11, 17)]
        steps.append(layer.step(x[:, 17:], state))
    assert_close(torch.cat([prompt, *steps], 1), full)
    assert state.recurrent.dtype == torch.float32
    assert state.conv.shape == (2, ARGS.linear_conv_kernel - 1, 56)


@pytest.mark.parametrize("short", [2, 5])  # shorter than the window, and longer
def test_a_left_padded_row_decodes_as_its_prompt_alone(short):
    layer = new_layer()
    x = torch.randn(2, 12 + 4, ARGS.dim, generator=torch.Generator().manual_seed(4))
    width = 12
    start = torch.tensor([width - short, 0])  # row 0 left-padded to the batch's width
    with torch.no_grad():
        # The decoder's way: the cache a fresh state, the mask a DecodeMask.
        state = GatedDeltaNetState.empty(ARGS, 2)
        prompt = layer(x[:, :width], mask=DecodeMask(start, torch.arange(width)),
                       cache=state)
        steps = [layer(x[:, t:t + 1], mask=DecodeMask(start, torch.tensor([t])), cache=state)
                 for t in range(width, width + 4)]
        batched = torch.cat([prompt, *steps], 1)
        alone = layer(x[:1, width - short:])
        valid = torch.arange(width)[None] >= start[:, None]
        by_prefill, _ = layer.prefill(x[:, :width], valid)
    assert_close(batched[:1, width - short:], alone)
    assert_close(batched[1:], layer(x[1:]))  # the unpadded row is untouched
    assert_close(by_prefill, prompt)


def test_fillers_after_a_step_token_stay_out_of_the_state():
    """A sequence-parallel decode step runs its token and fillers after it
    (``DecodeMask.real``): the state after it is the token's alone."""
    layer = new_layer()
    x = torch.randn(2, 9, ARGS.dim, generator=torch.Generator().manual_seed(6))
    start = torch.tensor([2, 0])
    with torch.no_grad():
        plain, filled = GatedDeltaNetState.empty(ARGS, 2), GatedDeltaNetState.empty(ARGS, 2)
        for state in (plain, filled):
            layer(x[:, :6], mask=DecodeMask(start, torch.arange(6)), cache=state)
        want = layer(x[:, 6:7], mask=DecodeMask(start, torch.tensor([6])), cache=plain)
        got = layer(x[:, 6:9], mask=DecodeMask(start, torch.arange(6, 9), real=1),
                    cache=filled)
    assert_close(got[:, :1], want)
    assert_close(filled.conv, plain.conv)  # (a 3-token projection rounds otherwise)
    assert_close(filled.recurrent, plain.recurrent)


def test_state_bytes_per_row_counts_both_parts():
    state = GatedDeltaNetState.empty(ARGS, 1, dtype=torch.bfloat16)
    expected = state.conv.numel() * 2 + state.recurrent.numel() * 4
    assert GatedDeltaNetState.bytes_per_row(ARGS, torch.bfloat16) == expected


def test_refuses_an_explicit_attention_mask_and_documents_while_decoding():
    layer = new_layer()
    x = torch.randn(1, 4, ARGS.dim)
    with pytest.raises(ValueError, match="DocumentMask or a DecodeMask"):
        layer(x, mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="not decoding"):
        layer(x, mask=DocumentMask(torch.zeros(1, 4, dtype=torch.long)),
              cache=GatedDeltaNetState.empty(ARGS, 1))


# --------------------------------------------------------------------- FLOPs

@pytest.mark.parametrize("seq", [8, 21])
def test_flops_count_the_products_torch_counts(seq):
    """torch counts the matrix products (projections and the rule's), not the shifted
    convolution nor the triangular solve: those two are ours alone."""
    layer = new_layer()
    x = torch.randn(1, seq, ARGS.dim)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(x)
    flops = forward_flops_per_token(ARGS, seq, chunk_size=CHUNK)
    assert counter.get_total_flops() == pytest.approx(
        seq * (flops.projections + flops.chunk_products))
    assert flops.conv == 2 * 4 * 56
    assert flops.total == pytest.approx(flops.projections + flops.conv + flops.chunk_products
                                        + flops.solve)


def test_chunked_rule_gradients_equal_the_recurrent_rules_with_and_without_documents():
    """Training differentiates the chunked form, through the triangular solve."""
    inputs = [t.requires_grad_() for t in rule_inputs(1, 13)]
    loss = lambda out, state: out.sin().sum() + state.cos().sum()  # noqa: E731

    def recurrent_by_document(lengths):
        """Each document alone, the initial state the first one's; the last one's state."""
        outs, start = [], 0
        for i, n in enumerate(lengths):
            part = [x[:, start:start + n] for x in inputs[:5]]
            out, state = recurrent_gated_delta_rule(
                *part, initial_state=inputs[5] if i == 0 else None)
            outs.append(out)
            start += n
        return torch.cat(outs, 1), state

    for lengths in ([13], [6, 7], [3, 5, 5]):
        segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        chunked = torch.autograd.grad(loss(*chunk_gated_delta_rule(
            *inputs[:5], chunk_size=CHUNK, initial_state=inputs[5],
            segments=segments[None])), inputs)
        expected = torch.autograd.grad(loss(*recurrent_by_document(lengths)), inputs)
        for ours, reference in zip(chunked, expected):
            assert_close(ours, reference)


def test_a_bf16_layer_rounds_as_transformers_bf16_layer():
    layer = new_layer()
    reference = Qwen3_5GatedDeltaNet(hf_config(Qwen3_5TextConfig), layer_idx=0)
    reference.load_state_dict(hf_state(layer))
    x = torch.randn(2, 40, ARGS.dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.no_grad():
        ours, theirs = layer.bfloat16()(x), reference.bfloat16()(x)
    assert ours.dtype == torch.bfloat16
    # Measured 0.003 (both are 0.01 to 0.07 from the fp32 layer, by the seed).
    assert (ours.float() - theirs.float()).norm() < 0.01 * theirs.float().norm()


def test_builds_on_the_meta_device_and_initialises_after_to_empty():
    with torch.device("meta"):
        layer = GatedDeltaNet(ARGS)
    layer.to_empty(device="cpu")
    layer.reset_parameters(std=0.02, out_std=0.01)
    assert 0.01 <= layer.A_log.exp().min() and layer.A_log.exp().max() <= 16
    assert torch.equal(layer.dt_bias, torch.ones(ARGS.linear_value_heads))
    assert layer(torch.randn(1, 3, ARGS.dim)).isfinite().all()
