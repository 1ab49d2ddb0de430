"""gpt-oss's MXFP4 expert weights (the released openai/gpt-oss-20b and -120b files) to
plain tensors, before ``moe_hf.from_hf(..., "gpt_oss")`` maps them.

The files hold, for each ``model.layers.{i}.mlp.experts.{gate_up_proj,down_proj}``, a
pair ``<name>_blocks`` (uint8, (experts, rows, groups, 16): two FP4 E2M1 codes a byte,
the low nibble first, 32 values a group) and ``<name>_scales`` (uint8, (experts, rows,
groups): one E8M0 power of two a group, bias 127). The dequantized tensor is transposed
to (experts, groups * 32, rows), which is transformers' in-memory GptOss layout:
gate_up_proj (experts, dim, 2 ffn), down_proj (experts, ffn, dim). The result is bit for
bit that of transformers' ``integrations.mxfp4.convert_moe_packed_tensors``.
"""
from __future__ import annotations

import torch

# E2M1 codes 0..15: the sign is bit 3, so codes 8..15 are the negatives of 0..7.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BYTES_PER_GROUP = 16  # 32 FP4 values
SCALE_BIAS = 127
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


class MXFP4Error(ValueError):
    """MXFP4 tensors that cannot be dequantized into the shapes the config asks for."""


def dequantized_shape(blocks: torch.Tensor) -> tuple[int, ...]:
    """(experts, groups * 32, rows) for blocks of (experts, rows, groups, 16)."""
    experts, rows, groups, group_bytes = blocks.shape
    return (experts, groups * group_bytes * 2, rows)


def check_shapes(blocks: torch.Tensor, scales: torch.Tensor,
                 expected_shape: tuple[int, ...] | None, name: str) -> None:
    """Refuse, in one line naming ``name``, blocks and scales that disagree with each
    other or whose dequantized shape is not ``expected_shape`` (None: not checked)."""
    pair = f"{name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}"
    if blocks.dim() != 4 or blocks.shape[-1] != BYTES_PER_GROUP:
        raise MXFP4Error(f"{pair}: blocks must be (experts, rows, groups, {BYTES_PER_GROUP})")
    if blocks.shape[:-1] != scales.shape:
        raise MXFP4Error(f"{pair} disagree: scales must be blocks' shape without its last dim")
    got = dequantized_shape(blocks)
    if expected_shape is not None and got != tuple(expected_shape):
        want = tuple(expected_shape)
        raise MXFP4Error(f"{pair} dequantize to {got} but the config expects {want}")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               rows_per_chunk: int = 4096) -> torch.Tensor:
    """(experts, rows, groups, 16) uint8 blocks and (experts, rows, groups) uint8 scales
    -> (experts, groups * 32, rows) in ``dtype``.

    Each chunk (one expert, at most ``rows_per_chunk`` rows) is written straight into its
    transposed place, so the peak is the output plus one chunk's temporaries rather than
    two copies of the output (a 120b gate_up_proj is 4 GiB in bf16)."""
    check_shapes(blocks, scales, None, "blocks")
    experts, rows = blocks.shape[:2]
    out = torch.empty(dequantized_shape(blocks), dtype=dtype, device=blocks.device)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    for expert in range(experts):
        for r0 in range(0, rows, rows_per_chunk):
            part = slice(r0, min(r0 + rows_per_chunk, rows))
            chunk = _decode(blocks[expert, part], scales[expert, part], lut)  # (chunk, groups * 32)
            out[expert, :, part] = chunk.T  # (groups * 32, chunk)
    return out


def _decode(blocks: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """(chunk, groups, 16) bytes and (chunk, groups) biased scales -> (chunk, groups * 32)."""
    blocks = blocks.to(torch.uint8)
    # the low nibble is the earlier value of the two
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)  # (chunk, groups, 16, 2)
    values = lut[codes.long()].flatten(2)  # (chunk, groups, 32)
    exponents = scales.to(torch.int32) - SCALE_BIAS  # (chunk, groups)
    # ldexp (x * 2**e computed in fp32, rounded once to dtype) as transformers does, so
    # even out-of-range exponents round the same way
    values = torch.ldexp(values, exponents.unsqueeze(-1))  # (chunk, groups, 32)
    return values.flatten(1)


def dequantize_state_dict(sd: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """``sd`` with each ``X_blocks``/``X_scales`` pair replaced by ``X`` dequantized
    (checked against ``expected[X]`` where present), in ``X_blocks``'s place; every other
    tensor is kept as it is (the same object)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        if key.endswith(SCALES_SUFFIX):
            _partner(sd, key[: -len(SCALES_SUFFIX)], BLOCKS_SUFFIX, key)
            continue
        if not key.endswith(BLOCKS_SUFFIX):
            out[key] = tensor
            continue
        name = key[: -len(BLOCKS_SUFFIX)]
        scales = _partner(sd, name, SCALES_SUFFIX, key)
        if name in sd:
            raise MXFP4Error(f"{name}: the state dict holds both {name} and {key}")
        check_shapes(tensor, scales, expected.get(name), name)
        out[name] = dequantize(tensor, scales, dtype)
    return out


def _partner(sd: dict[str, torch.Tensor], name: str, suffix: str, key: str) -> torch.Tensor:
    """The other half of ``key``'s MXFP4 pair, or a refusal naming ``key``."""
    if name + suffix not in sd:
        raise MXFP4Error(f"{key}: MXFP4 tensor without its {name + suffix}")
    return sd[name + suffix]
