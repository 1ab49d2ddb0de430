"""The CPU decode's packed linear weights: the same products and tokens as the plain
forward, only plain fp32 linears packed, everything put back after, nothing packed when the
copy would not fit, and one packing per ``generate_in_batches`` call; under CPU autocast
(a bf16 or fp16 run's end-of-run sample) packed in autocast's dtype where this CPU can,
and a call in another dtype than the packed one runs the plain forward."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lmforge.models.generate as gen
from helpers.packing import record_packings
from helpers.tiny_models import tiny_llama_args
from lmforge.models.generate import Sampling, generate, generate_in_batches
from lmforge.models.llama import build_llama, materialize
from lmforge.models.packed_linear import available, packed_linears
from lmforge.peft.lora import LoraLinear

PROMPTS = [[(7 * i + 3 * j) % 50 + 1 for j in range(n)] for i, n in enumerate([5, 1, 9, 12])]
BIG = 1 << 40


def _model(**changes):
    torch.manual_seed(3)
    return materialize(build_llama(tiny_llama_args(vocab_size=53, **changes)), "cpu").eval()


@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_product_equals_the_plain_one(rows, bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    with packed_linears(layer, 1, BIG) as packed:
        assert packed == 1
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_k=20)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_packed_decoding_gives_the_plain_decodes_tokens(monkeypatch, sampling, tie):
    model = _model(tie_embeddings=tie)
    packed = generate(model, PROMPTS, 10, sampling, seeds=[1, 2, 3, 4])
    monkeypatch.setattr(gen, "packed_linears",  # (no room: nothing packed)
                        lambda model, rows, budget: packed_linears(model, rows, 0))
    plain = generate(model, PROMPTS, 10, sampling, seeds=[1, 2, 3, 4])
    for a, b in zip(packed, plain):
        assert a.ids == b.ids
        torch.testing.assert_close(a.model_logprobs, b.model_logprobs, rtol=0, atol=1e-5)


def test_only_plain_fp32_linears_are_packed_and_all_are_put_back():
    model = _model()
    lora = LoraLinear.from_linear(model.layers["0"].attention.q_proj, rank=2, alpha=4)
    model.layers["0"].attention.q_proj = lora
    model.layers["1"].feed_forward.up_proj.to(torch.bfloat16)
    plain = [m for m in model.modules() if type(m) is nn.Linear
             and m.weight.dtype == torch.float32]
    with pytest.raises(RuntimeError, match="inside"):
        with packed_linears(model, 4, BIG) as packed:
            assert packed == len(plain)
            assert all("forward" in m.__dict__ for m in plain)
            assert "forward" not in lora.__dict__
            assert "forward" not in model.layers["1"].feed_forward.up_proj.__dict__
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_nothing_is_packed_when_the_copy_would_not_fit():
    model = _model()
    weights = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is nn.Linear)
    with packed_linears(model, 1, 2 * weights - 1) as packed:
        assert packed == 0
        assert not any("forward" in m.__dict__ for m in model.modules())


def test_generate_in_batches_packs_the_weights_once(monkeypatch):
    model = _model()
    packed = record_packings(monkeypatch)
    generate_in_batches(model, PROMPTS * 3, 4, batch_size=4)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert packed == [linears, 0, 0, 0]  # (the batches find them packed already)


def test_sibling_projections_share_one_product_and_give_each_its_own_columns():
    model = _model(attention_bias=True)  # (q, k and v with biases, as Qwen2's)
    attention = model.layers["0"].attention
    with torch.no_grad():
        for p in (attention.q_proj, attention.k_proj, attention.v_proj):
            p.bias.normal_()
    x = torch.randn(2, 3, attention.q_proj.in_features)
    plain = [F.linear(x, p.weight, p.bias) for p in
             (attention.q_proj, attention.k_proj, attention.v_proj)]
    with packed_linears(model, 2, BIG):
        k = attention.k_proj(x)  # (any order: the first call makes the whole product)
        q, v = attention.q_proj(x), attention.v_proj(x)
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        other = attention.v_proj(x.clone())  # (another tensor: a product of its own)
    for got, want in zip((q, k, v, other), plain + [plain[2]]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_shared_product_is_let_go_once_every_sibling_has_taken_its_columns():
    from lmforge.perf.tracker import TensorMemoryTracker

    model = _model()
    attention = model.layers["0"].attention
    x = torch.randn(4, 16, attention.q_proj.in_features)
    with packed_linears(model, 4, BIG):
        tracker = TensorMemoryTracker()
        with tracker:
            before = tracker.live
            q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
            assert tracker.live > before
            del q, k, v  # (the callers' views were the last references to the product)
            assert tracker.live == before


def test_a_model_with_compiled_blocks_is_not_packed():
    model = _model()
    model.layers["1"].compile()  # (as train.compile does; nothing compiles until called)
    with packed_linears(model, 1, BIG) as packed:
        assert packed == 0  # (the compiler cannot trace a packed weight)
        assert not any("forward" in m.__dict__ for m in model.modules())


LOW = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True])
def test_under_autocast_the_weights_are_packed_in_its_dtype_and_give_its_product(dtype, bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 160, bias=bias)
    x = torch.randn(3, 96)  # (fp32, as a norm's output reaches a projection under autocast)
    with torch.autocast("cpu", dtype=dtype):
        want = F.linear(x, layer.weight, layer.bias)
        with packed_linears(layer, 1, BIG) as packed:
            got = layer(x)
    assert packed == int(available(dtype))  # (fp16: only CPUs with AVX512-FP16 / NE-CONVERT)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_a_layer_called_in_another_dtype_than_it_was_packed_in_runs_its_plain_forward():
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    x = torch.randn(2, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_low = F.linear(x, layer.weight, layer.bias)
    want = F.linear(x, layer.weight, layer.bias)
    with packed_linears(layer, 1, BIG) as packed:  # (packed for fp32 products)
        assert packed == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):  # (autocast entered inside)
            got_low = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with packed_linears(layer, 1, BIG) as packed:  # (packed for bf16 products)
            assert packed == int(available(torch.bfloat16))
            with torch.autocast("cpu", enabled=False):  # (autocast left inside)
                got = layer(x)
    assert got_low.dtype == torch.bfloat16 and got.dtype == torch.float32
    torch.testing.assert_close(got_low, want_low, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_packed_decoding_under_autocast_gives_the_plain_decodes_tokens(monkeypatch, dtype):
    model = _model(attention_bias=True)
    with torch.autocast("cpu", dtype=dtype):
        packed = generate(model, PROMPTS, 10, seeds=[1, 2, 3, 4])
        monkeypatch.setattr(gen, "packed_linears",  # (no room: nothing packed)
                            lambda model, rows, budget: packed_linears(model, rows, 0))
        plain = generate(model, PROMPTS, 10, seeds=[1, 2, 3, 4])
    for a, b in zip(packed, plain):
        assert a.ids == b.ids
        torch.testing.assert_close(a.model_logprobs, b.model_logprobs, rtol=0, atol=2e-2)


@pytest.mark.skipif(not available(), reason="oneDNN cannot pack fp32 on this CPU")
def test_moe_experts_are_packed_when_chosen_and_give_the_grouped_products_output():
    """CPU decoding packs each expert's weights the first time a token chooses it (a
    short decode reads few), runs only the chosen experts, and gives the grouped
    product's output; the plain product comes back after."""
    from lmforge.models.moe import GroupedExperts
    from lmforge.models.registry import PRESETS, build_model

    torch.manual_seed(0)
    model = materialize(build_model(PRESETS["qwen3-moe-debug"]), "cpu").eval()
    x = torch.randint(0, model.args.vocab_size, (1, 3))
    with torch.no_grad():
        plain = model(x)
        with packed_linears(model, 1, 10**12) as packed:
            stacks = [m for m in model.modules() if type(m) is GroupedExperts]
            assert packed and all("product" in m.__dict__ for m in stacks)
            got = model(x)
            chosen = {e for _, e in stacks[0].product.packed}
            assert 0 < len(chosen) <= 3 * model.args.top_k < model.args.n_experts
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    assert not any("product" in m.__dict__ for m in stacks)
