"""gpt-oss's MXFP4 expert tensors (models/mxfp4.py) dequantize bit for bit as
transformers' ``convert_moe_packed_tensors`` does, fp32 and bf16, whatever the chunking;
blocks and scales that disagree with each other or with the config, and a half pair in a
state dict, are refused in one line naming the tensor; other tensors pass untouched.
Tiny gpt-oss shapes on the CPU."""
from __future__ import annotations

import pytest
import torch

from lmforge.models import mxfp4
from lmforge.models.mxfp4 import MXFP4Error

EXPERTS, DIM, FFN = 4, 96, 32  # dim != 2 ffn and != ffn: a transposed result fails
PREFIX = "model.layers.0.mlp.experts."


def _packed(rows: int, cols: int, scale_range=(118, 131), seed: int = 0):
    """Random blocks (experts, rows, cols / 32, 16) and scales (experts, rows, cols / 32),
    as the checkpoint stores a tensor that dequantizes to (experts, cols, rows)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(*scale_range, blocks.shape[:-1], dtype=torch.uint8, generator=g)
    return blocks, scales


def _tiny_checkpoint():
    """gate_up_proj dequantizes to (experts, dim, 2 ffn), down_proj to (experts, ffn, dim)."""
    gate_up = _packed(2 * FFN, DIM, seed=1)
    down = _packed(DIM, FFN, seed=2)
    return {"gate_up_proj": gate_up, "down_proj": down}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so -0.0 != 0.0 and equal NaNs compare equal."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def test_fp4_values_are_transformers():
    from transformers.integrations.mxfp4 import FP4_VALUES

    assert torch.equal(_bits(torch.tensor(mxfp4.FP4_VALUES)), _bits(torch.tensor(FP4_VALUES)))


def test_one_byte_low_nibble_first():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x2F  # low nibble 15 (-6.0), high nibble 2 (1.0)
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)  # 2**1
    out = mxfp4.dequantize(blocks, scales, torch.float32)
    assert out.shape == (1, 32, 1)
    assert out[0, :2, 0].tolist() == [-12.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_chunk", [5, 4096])
@pytest.mark.parametrize("proj", ["gate_up_proj", "down_proj"])
def test_matches_transformers_bit_for_bit(proj, rows_per_chunk, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _tiny_checkpoint()[proj]
    ours = mxfp4.dequantize(blocks, scales, dtype, rows_per_chunk=rows_per_chunk)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    want = {"gate_up_proj": (EXPERTS, DIM, 2 * FFN), "down_proj": (EXPERTS, FFN, DIM)}[proj]
    assert ours.shape == theirs.shape == want and ours.dtype == theirs.dtype == dtype
    assert ours.is_contiguous()
    assert torch.equal(_bits(ours), _bits(theirs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_exponent_rounds_as_transformers(dtype):
    # the whole E8M0 range: subnormals, underflow to zero, overflow to inf and 0 * inf
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _packed(8, 64, scale_range=(0, 256), seed=3)
    ours = mxfp4.dequantize(blocks, scales, dtype, rows_per_chunk=3)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert torch.equal(_bits(ours), _bits(theirs))


def _refusal(match: str):
    return pytest.raises(MXFP4Error, match=match)


def _one_line(info) -> None:
    assert "\n" not in str(info.value)


def test_blocks_and_scales_that_disagree_are_refused():
    blocks, scales = _tiny_checkpoint()["down_proj"]
    with _refusal(r"down_proj: blocks \(4, 96, 1, 16\) and scales \(4, 96, 2\) disagree") as info:
        mxfp4.check_shapes(blocks, torch.cat((scales, scales), -1), None, "down_proj")
    _one_line(info)
    with _refusal(r"down_proj: blocks \(4, 96, 1, 8\) .*\(experts, rows, groups, 16\)") as info:
        mxfp4.check_shapes(blocks[..., :8], scales, None, "down_proj")
    _one_line(info)


def test_blocks_that_disagree_with_the_config_are_refused():
    blocks, scales = _tiny_checkpoint()["gate_up_proj"]
    mxfp4.check_shapes(blocks, scales, (EXPERTS, DIM, 2 * FFN), "gate_up_proj")
    with _refusal(r"gate_up_proj: blocks \(4, 64, 3, 16\) and scales \(4, 64, 3\) dequantize to "
                  r"\(4, 96, 64\) but the config expects \(4, 128, 64\)") as info:
        mxfp4.check_shapes(blocks, scales, (EXPERTS, 128, 2 * FFN), "gate_up_proj")
    _one_line(info)


def _state_dict():
    packed = _tiny_checkpoint()
    sd = {"model.embed_tokens.weight": torch.randn(10, DIM)}
    for proj, (blocks, scales) in packed.items():
        sd[PREFIX + proj + "_blocks"], sd[PREFIX + proj + "_scales"] = blocks, scales
        sd[PREFIX + proj + "_bias"] = torch.randn(EXPERTS, blocks.shape[1])  # 2 ffn, or dim
    return sd


def _expected():
    return {PREFIX + "gate_up_proj": (EXPERTS, DIM, 2 * FFN),
            PREFIX + "down_proj": (EXPERTS, FFN, DIM)}


def test_state_dict_pairs_become_tensors_and_the_rest_is_untouched():
    sd = _state_dict()
    out = mxfp4.dequantize_state_dict(sd, _expected(), torch.float32)
    assert sorted(out) == sorted(["model.embed_tokens.weight"] + [
        PREFIX + p + s for p in ("gate_up_proj", "down_proj") for s in ("", "_bias")])
    for key, tensor in out.items():
        if key in sd:
            assert tensor is sd[key]
    for proj in ("gate_up_proj", "down_proj"):
        name = PREFIX + proj
        want = mxfp4.dequantize(sd[name + "_blocks"], sd[name + "_scales"], torch.float32)
        assert out[name].shape == _expected()[name] and torch.equal(out[name], want)
    in_bf16 = mxfp4.dequantize_state_dict(sd, {}, torch.bfloat16)
    assert in_bf16[PREFIX + "down_proj"].dtype == torch.bfloat16


@pytest.mark.parametrize("drop", ["_scales", "_blocks"])
def test_half_a_pair_is_refused(drop):
    sd = _state_dict()
    del sd[PREFIX + "down_proj" + drop]
    kept = PREFIX + "down_proj" + {"_scales": "_blocks", "_blocks": "_scales"}[drop]
    with _refusal(f"{kept}: MXFP4 tensor without its {PREFIX}down_proj{drop}") as info:
        mxfp4.dequantize_state_dict(sd, _expected(), torch.float32)
    _one_line(info)


def test_state_dict_against_the_config_is_refused():
    expected = {**_expected(), PREFIX + "down_proj": (EXPERTS, FFN, 2 * DIM)}
    with _refusal(f"{PREFIX}down_proj: blocks .* but the config expects \\(4, 32, 192\\)") as info:
        mxfp4.dequantize_state_dict(_state_dict(), expected, torch.float32)
    _one_line(info)


def test_a_tensor_both_plain_and_packed_is_refused():
    sd = {**_state_dict(), PREFIX + "down_proj": torch.zeros(EXPERTS, FFN, DIM)}
    with _refusal(f"{PREFIX}down_proj: the state dict holds both"):
        mxfp4.dequantize_state_dict(sd, _expected(), torch.float32)


def test_result_goes_through_the_gpt_oss_mapping():
    from lmforge.models import moe_hf

    sd = _state_dict()
    out = mxfp4.dequantize_state_dict(sd, _expected(), torch.float32)
    mlp = {k.removeprefix("model.layers.0.mlp."): v for k, v in out.items() if k.startswith(PREFIX)}
    ours = moe_hf.from_hf(mlp, "gpt_oss")
    assert ours["experts.gate_up_proj"].shape == (EXPERTS, 2 * FFN, DIM)
    assert ours["experts.down_proj"].shape == (EXPERTS, DIM, FFN)
