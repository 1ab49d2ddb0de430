"""On a CUDA device with flash-linear-attention installed (``pytest -m gpu``; skipped
otherwise): FLA's kernels, which a Gated DeltaNet layer takes there
(models/delta_rule.py ``rules``), equal the PyTorch rules within bf16's tolerance:
outputs, final states and gradients, over packed documents and from a state, and a
whole layer's output and gradients in a bf16 run."""
from __future__ import annotations

import pytest
import torch

from lmforge.models import delta_rule
from lmforge.models.delta_rule import FlaRules, chunk_gated_delta_rule, recurrent_gated_delta_rule
from lmforge.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetArgs, l2_normalize

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(delta_rule._fla_module() is None,
                                 reason="flash-linear-attention is not installed")]
BF16 = 2e-2  # relative to the reference's norm: bf16 inputs, fp32 accumulation


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    error = (got.float() - want.float()).norm() / want.float().norm()
    assert error < BF16, f"relative error {error:.2e}"


def inputs(batch=2, seq=300, heads=4, dk=128, dv=128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    q, k = l2_normalize(rand(batch, seq, heads, dk)), l2_normalize(rand(batch, seq, heads, dk))
    return (q, k, rand(batch, seq, heads, dv).bfloat16(),
            -torch.nn.functional.softplus(rand(batch, seq, heads)),
            rand(batch, seq, heads).sigmoid(),
            rand(batch, heads, dk, dv) * 0.1)


@pytest.mark.parametrize("documents", [False, True])
def test_fla_chunk_equals_the_pytorch_rule_with_gradients(documents):
    q, k, v, g, beta, state = inputs()
    segments = (torch.repeat_interleave(torch.arange(3, device="cuda"),
                                        torch.tensor([70, 150, 80], device="cuda"))
                .expand(2, 300) if documents else None)
    initial = None if documents else state
    fla = delta_rule._fla_module()
    results = {}
    for name, rule in (("torch", chunk_gated_delta_rule), ("fla", FlaRules(fla).chunk)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)]
        out, final = rule(*leaves, initial_state=initial, segments=segments)
        out.float().square().sum().backward()
        results[name] = (out, final, [t.grad for t in leaves])
    (out, final, grads), (ref, ref_final, ref_grads) = results["fla"], results["torch"]
    close(out, ref)
    if not documents:
        close(final, ref_final)
    for got, want in zip(grads, ref_grads):
        close(got, want)


def test_fla_recurrent_step_equals_the_pytorch_step():
    q, k, v, g, beta, state = inputs(seq=1)
    fla = delta_rule._fla_module()
    got = FlaRules(fla).recurrent(q, k, v, g, beta, initial_state=state)
    want = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    for a, b in zip(got, want):
        close(a, b)


def test_a_bf16_layer_on_fla_equals_the_layer_on_the_pytorch_rules(monkeypatch):
    args = GatedDeltaNetArgs(dim=256, linear_key_heads=2, linear_value_heads=4)
    torch.manual_seed(0)
    layer = GatedDeltaNet(args).cuda()
    layer.reset_parameters(std=0.02, out_std=0.02)
    x = torch.randn(2, 200, 256, device="cuda")
    results = {}
    for name in ("fla", "torch"):
        if name == "torch":  # (the CPU's choice, forced on the GPU)
            monkeypatch.setattr("lmforge.models.gated_deltanet.rules", lambda device: (
                chunk_gated_delta_rule, recurrent_gated_delta_rule))
        layer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
        out.float().square().sum().backward()
        results[name] = (out, {n: p.grad.clone() for n, p in layer.named_parameters()})
    close(results["fla"][0], results["torch"][0])
    for name, grad in results["torch"][1].items():
        close(results["fla"][1][name], grad)
