"""The MoE block (models/moe.py) routes every token to the same experts as transformers'
own Qwen3-MoE, Mixtral, gpt-oss and DeepSeek-V3 blocks and gives the same output from
the same weights (mapped by ``moe_hf.from_hf``); its load-balancing loss is transformers';
its grouped expert products (``torch._grouped_mm`` and the padded fallback) equal a
per-assignment loop, values and gradients, with idle experts and a single token; bad
configs are refused naming the field. fp32 on the CPU, tiny shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.models import grouped_mm, moe, moe_hf
from lmforge.models.moe import MoE, MoEArgs

DIM, FFN, EXPERTS = 32, 12, 8  # FFN != DIM and 2 FFN != DIM: a transposed layout fails


def _hf_block(family: str, **fields):
    """transformers' own sparse-MoE block for ``family`` from a tiny config, random
    weights (and correction bias), with the plain per-expert loop ("eager")."""
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config_class, block_class = {
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeSparseMoeBlock),
        "mixtral": (MixtralConfig, MixtralSparseMoeBlock),
        "gpt_oss": (GptOssConfig, GptOssMLP),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3MoE),
    }[family]
    config = config_class(hidden_size=DIM, **fields)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = block_class(config).eval()
    with torch.no_grad():
        for tensor in block.state_dict().values():
            tensor.copy_(torch.randn_like(tensor) * 0.3)
    return block, config


def _our_args(family: str, config) -> MoEArgs:
    """What a family's hf.py will read from config.json."""
    common = dict(dim=config.hidden_size, top_k=config.num_experts_per_tok)
    if family == "qwen3_moe":
        return MoEArgs(n_experts=config.num_experts, ffn_dim=config.moe_intermediate_size,
                       norm_topk_prob=config.norm_topk_prob, **common)
    if family == "mixtral":
        return MoEArgs(n_experts=config.num_local_experts, ffn_dim=config.intermediate_size,
                       **common)
    if family == "gpt_oss":
        return MoEArgs(n_experts=config.num_local_experts, ffn_dim=config.intermediate_size,
                       router="topk_softmax", router_bias=True, activation="clamped_swiglu",
                       expert_bias=True, swiglu_alpha=config.swiglu_alpha,
                       swiglu_limit=config.swiglu_limit, **common)
    return MoEArgs(n_experts=config.n_routed_experts, ffn_dim=config.moe_intermediate_size,
                   router="sigmoid_group_topk", norm_topk_prob=config.norm_topk_prob,
                   n_groups=config.n_group, topk_groups=config.topk_group,
                   routed_scaling_factor=config.routed_scaling_factor,
                   n_shared_experts=config.n_shared_experts, **common)


FAMILIES = {  # id -> (family, HF layout, config fields)
    "qwen3_moe-renormalised": ("qwen3_moe", "fused", dict(
        moe_intermediate_size=FFN, num_experts=EXPERTS, num_experts_per_tok=2,
        norm_topk_prob=True)),
    "qwen3_moe-raw-weights": ("qwen3_moe", "fused", dict(
        moe_intermediate_size=FFN, num_experts=EXPERTS, num_experts_per_tok=3,
        norm_topk_prob=False)),
    "mixtral": ("mixtral", "fused", dict(
        intermediate_size=FFN, num_local_experts=EXPERTS, num_experts_per_tok=2)),
    "gpt_oss": ("gpt_oss", "gpt_oss", dict(
        intermediate_size=FFN, num_local_experts=EXPERTS, num_experts_per_tok=4,
        swiglu_limit=1.0)),  # (small enough that the clamps bite)
    "deepseek_v3-groups-bias-shared-scaled": ("deepseek_v3", "fused", dict(
        moe_intermediate_size=FFN, n_routed_experts=EXPERTS, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
        norm_topk_prob=True)),
}


def _ours_from(hf_block, family: str, config, layout: str) -> MoE:
    ours = MoE(_our_args(family, config))
    ours.load_state_dict(moe_hf.from_hf(hf_block.state_dict(), layout), strict=True)
    return ours.eval()


def _sorted_choice(indices: torch.Tensor, weights: torch.Tensor):
    """The chosen experts in ascending order with their weights (DeepSeek-V3's top-k is
    unsorted in transformers)."""
    order = indices.argsort(dim=-1)
    return indices.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_routing_and_output_equal_transformers_block(case):
    family, layout, fields = FAMILIES[case]
    hf_block, config = _hf_block(family, **fields)
    ours = _ours_from(hf_block, family, config, layout)
    x = torch.randn(3, 5, DIM)  # (batch, seq, dim)

    with torch.no_grad():
        router = hf_block.router if family == "gpt_oss" else hf_block.gate
        hf_logits, hf_weights, hf_indices = router(x.reshape(-1, DIM))
        hf_out = hf_block(x)
        hf_out = hf_out[0] if isinstance(hf_out, tuple) else hf_out
        out, routing = ours(x)

    want_idx, want_w = _sorted_choice(hf_indices, hf_weights)
    got_idx, got_w = _sorted_choice(routing.indices, routing.weights)
    assert torch.equal(got_idx, want_idx)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(routing.logits, hf_logits.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, hf_out, rtol=1e-5, atol=1e-5)


def test_deepseek_correction_bias_changes_the_choice_but_not_the_weights():
    """A large bias on expert 5 makes every token choose it, while its weight stays its
    uncorrected sigmoid score."""
    args = MoEArgs(dim=DIM, n_experts=EXPERTS, top_k=2, ffn_dim=FFN,
                   router="sigmoid_group_topk", n_groups=4, topk_groups=2,
                   norm_topk_prob=False)
    router = moe.Router(args)
    router.reset_parameters(0.5)
    x = torch.randn(6, DIM)
    router.e_score_correction_bias[5] = 10.0
    routing = router(x)
    assert (routing.indices == 5).any(dim=-1).all()
    scores = routing.logits.sigmoid()
    torch.testing.assert_close(routing.weights, scores.gather(1, routing.indices))


@pytest.mark.parametrize("masked", [False, True], ids=["all-tokens", "padding-masked"])
def test_load_balancing_loss_equals_transformers(masked):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(1)
    batch, seq, top_k = 2, 6, 2
    logits = tuple(torch.randn(batch * seq, EXPERTS) for _ in range(2))  # 2 layers
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2]) if masked else None
    want = load_balancing_loss_func(logits, EXPERTS, top_k, mask)
    got = moe.load_balancing_loss(logits, top_k, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------- grouped products

def _reference_experts(experts: moe.GroupedExperts, x, indices, weights):
    """One assignment at a time: out[t] += w * down(act(gate_up(x[t]))), biases and all."""
    rows = []
    for t in range(x.shape[0]):
        row = x.new_zeros(x.shape[1])
        for k in range(indices.shape[1]):
            e = int(indices[t, k])
            h = experts.gate_up_proj[e] @ x[t]
            if experts.gate_up_proj_bias is not None:
                h = h + experts.gate_up_proj_bias[e]
            y = experts.down_proj[e] @ experts.activate(h)
            if experts.down_proj_bias is not None:
                y = y + experts.down_proj_bias[e]
            row = row + weights[t, k] * y
        rows.append(row)
    return torch.stack(rows)


@pytest.fixture(params=["grouped_mm", "padded_bmm"])
def product(request, monkeypatch):
    """Each of the two grouped-product paths, whichever this machine would choose."""
    if request.param == "grouped_mm":
        if not grouped_mm.grouped_mm_supported("cpu", torch.float32):
            pytest.skip("torch._grouped_mm does not run on this CPU")
    else:
        monkeypatch.setattr(grouped_mm, "grouped_mm_supported", lambda *_: False)
    return request.param


@pytest.mark.parametrize("tokens,activation", [(7, "swiglu"), (1, "swiglu"),
                                               (7, "clamped_swiglu")],
                         ids=["7-tokens", "1-token", "7-tokens-clamped-biased"])
def test_grouped_experts_equal_per_assignment_loop_values_and_gradients(product, tokens,
                                                                       activation):
    args = MoEArgs(dim=DIM, n_experts=EXPERTS, top_k=2, ffn_dim=FFN, activation=activation,
                   expert_bias=activation == "clamped_swiglu", swiglu_limit=0.5)
    torch.manual_seed(2)
    experts = moe.GroupedExperts(args)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(tokens, DIM, requires_grad=True)
    # Only experts 1, 3 and 6 are chosen (one token: 1 and 3): the others get none.
    indices = torch.tensor([[1, 3], [6, 1], [3, 6], [1, 6], [6, 3], [3, 1], [1, 3]])[:tokens]
    weights = torch.rand(tokens, 2, requires_grad=True)
    grad_out = torch.randn(tokens, DIM)

    got = experts(x, indices, weights)
    want = _reference_experts(experts, x, indices, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    inputs = [x, weights, *experts.parameters()]
    got_grads = torch.autograd.grad(got, inputs, grad_out)
    want_grads = torch.autograd.grad(want, inputs, grad_out)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    idle = torch.ones(EXPERTS, dtype=torch.bool)
    idle[indices.flatten()] = False
    assert (got_grads[2][idle] == 0).all()  # gate_up_proj: the idle experts untouched
    assert (got_grads[2][~idle] != 0).any(dim=(1, 2)).all()


def test_an_expanded_gradient_reaches_the_grouped_product(product):
    """A plain ``.sum()`` sends back a gradient of stride 0, which ``_grouped_mm``'s
    backward refuses unless it is made contiguous."""
    x = torch.randn(5, DIM, requires_grad=True)
    weight = torch.randn(2, FFN, DIM, requires_grad=True)
    counts, experts = torch.tensor([2, 3]), torch.tensor([0, 0, 1, 1, 1])
    grouped_mm.grouped_linear(x, weight, counts, experts).sum().backward()
    torch.testing.assert_close(weight.grad[0], x[:2].sum(0).expand(FFN, DIM))


@pytest.mark.parametrize("width", [6, 10], ids=["ffn-6", "dim-10"])
def test_widths_grouped_mm_refuses_take_the_padded_product(width):
    """``torch._grouped_mm`` wants 16-byte row strides (fp32: widths that 4 divides);
    the cached probe cannot see that, so other widths take the padded product."""
    torch.manual_seed(4)
    x = torch.randn(5, width, requires_grad=True)
    weight = torch.randn(2, 8, width, requires_grad=True)
    counts, experts = torch.tensor([2, 3]), torch.tensor([0, 0, 1, 1, 1])
    got = grouped_mm.grouped_linear(x, weight, counts, experts)
    want = torch.cat([x[:2] @ weight[0].T, x[2:] @ weight[1].T])
    torch.testing.assert_close(got, want)
    got.sum().backward()
    torch.testing.assert_close(weight.grad[1], x[2:].sum(0).expand(8, width))


def test_bf16_autocast_takes_bf16_rows_on_fp32_weights(product):
    """The training loop's mixed precision: fp32 weights, autocast, and rows that an
    earlier autocast op made bf16. ``_grouped_mm`` is not on autocast's list (mixed dtypes
    fail), so the block casts for it."""
    args = MoEArgs(dim=DIM, n_experts=EXPERTS, top_k=2, ffn_dim=16, n_shared_experts=1)
    block = MoE(args)
    block.reset_parameters(0.1)
    x = torch.randn(2, 5, DIM)
    want, _ = block(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = block(x.bfloat16())
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02)
    got.float().square().sum().backward()
    assert block.experts.gate_up_proj.grad.dtype == torch.float32


def test_router_and_shared_experts_receive_gradients():
    args = MoEArgs(dim=DIM, n_experts=EXPERTS, top_k=2, ffn_dim=FFN, n_shared_experts=1)
    block = MoE(args)
    block.reset_parameters(0.1)
    out, _ = block(torch.randn(2, 3, DIM))
    out.square().sum().backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# ------------------------------------------------------------- balancing, init

def test_load_statistic_is_busiest_expert_over_the_mean():
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3]])  # loads 4, 2, 1, 1 over 4 experts
    counts = grouped_mm.tokens_per_expert(indices, 4)
    assert counts.tolist() == [4, 2, 1, 1]
    assert moe.max_load_ratio(counts).item() == pytest.approx(2.0)
    assert moe.max_load_ratio(torch.tensor([[2, 2], [4, 0]])).tolist() == [1.0, 2.0]


def test_correction_bias_moves_towards_the_mean_load():
    args = MoEArgs(dim=DIM, n_experts=4, top_k=1, ffn_dim=FFN, router="sigmoid_group_topk",
                   n_groups=2, topk_groups=1)
    router = moe.Router(args)
    router.reset_parameters(0.02)
    moe.update_correction_bias(router, torch.tensor([6, 1, 3, 2]), step_size=0.01)
    assert router.e_score_correction_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    with pytest.raises(ValueError, match="router"):
        moe.update_correction_bias(moe.Router(MoEArgs(DIM, 4, 1, FFN)), torch.ones(4), 0.01)


def test_reset_parameters_on_a_meta_built_block():
    args = MoEArgs(dim=DIM, n_experts=EXPERTS, top_k=2, ffn_dim=FFN, router="topk_softmax",
                   router_bias=True, expert_bias=True, activation="clamped_swiglu")
    with torch.device("meta"):
        block = MoE(args)
    block.to_empty(device="cpu")
    block.reset_parameters(0.02, out_std=0.005)
    assert block.experts.gate_up_proj.std().item() == pytest.approx(0.02, rel=0.2)
    assert block.experts.down_proj.std().item() == pytest.approx(0.005, rel=0.2)
    assert not block.gate.bias.any() and not block.experts.down_proj_bias.any()
    assert torch.isfinite(block(torch.randn(4, DIM))[0]).all()


# ------------------------------------------------------------- HF layouts, config

@pytest.mark.parametrize("layout", moe_hf.HF_LAYOUTS)
def test_hf_layouts_round_trip(layout):
    args = MoEArgs(dim=DIM, n_experts=EXPERTS, top_k=2, ffn_dim=FFN, router_bias=True,
                   expert_bias=layout == "gpt_oss")
    block = MoE(args)
    block.reset_parameters(0.1)
    ours = block.state_dict()
    hf = moe_hf.to_hf(ours, layout)
    back = moe_hf.from_hf(hf, layout)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) for k in ours)
    if layout == "per_expert":  # transformers' loader: stack experts, cat gate and up
        assert hf["experts.5.up_proj.weight"].shape == (FFN, DIM)
        torch.testing.assert_close(hf["experts.5.up_proj.weight"],
                                   ours["experts.gate_up_proj"][5, FFN:])


def test_per_expert_layout_is_what_transformers_writes_to_disk(tmp_path):
    """transformers 5 saves Qwen3-MoE's stacked experts one by one; ``per_expert`` reads
    those files into its in-memory (and our) layout, and writes them back."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=DIM, moe_intermediate_size=FFN, num_experts=4,
                            num_experts_per_tok=2, num_hidden_layers=1, vocab_size=50,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(3)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    model = Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    prefix = "model.layers.0.mlp."
    files = {k[len(prefix):]: v for k, v in load_file(tmp_path / "model.safetensors").items()
             if k.startswith(prefix)}
    in_memory = model.model.layers[0].mlp.state_dict()
    ours = moe_hf.from_hf(files, "per_expert")
    assert ours.keys() == in_memory.keys()
    assert all(torch.equal(ours[k], in_memory[k]) for k in ours)
    back = moe_hf.to_hf(ours, "per_expert")
    assert back.keys() == files.keys() and all(torch.equal(back[k], files[k]) for k in back)
    del files["experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"^experts\.2\.up_proj\.weight: missing"):
        moe_hf.from_hf(files, "per_expert")


@pytest.mark.parametrize("fields,field", [
    (dict(top_k=9), "top_k"),
    (dict(router="expert_choice"), "router"),
    (dict(activation="gelu"), "activation"),
    (dict(router="sigmoid_group_topk", n_groups=3), "n_groups"),
    (dict(router="sigmoid_group_topk", n_groups=2, topk_groups=3), "topk_groups"),
    (dict(router="sigmoid_group_topk", n_groups=4, topk_groups=1, top_k=3), "top_k"),
    (dict(ffn_dim=0), "ffn_dim"),
])
def test_bad_config_is_refused_naming_the_field(fields, field):
    base = dict(dim=DIM, n_experts=EXPERTS, top_k=2, ffn_dim=FFN)
    with pytest.raises(ValueError, match=rf"^{field}: "):
        MoEArgs(**{**base, **fields})

