"""The hybrid families' share of ``family_training``: the same worker and data, with a
tiny Qwen3.5 (three Gated DeltaNet layers, then a gated full-attention one), Qwen3-Next
and Qwen3.5-MoE (the same stack with a mixture of experts and its gated shared expert)
in the layouts a linear-attention model takes (pp and cp are refused for it): FSDP2,
tensor parallelism (the linear layers split by heads) with and without sequence
parallelism, LoRA on every linear (the DeltaNet's projections among them; an MoE's
experts too) under FSDP2, and rows of packed documents (each restarting
the linear layers' state) under both, each against one process, 3 steps.

``torchrun --nproc-per-node=2 hybrid_training.py OUT`` writes OUT/results-2.json as
``family_training`` does."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # (run as a script by torchrun: the tests' folder importable)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import family_training as ft  # noqa: E402
from lmforge.models.registry import PRESETS  # noqa: E402

STEPS = 3
FAMILIES = {name: dataclasses.replace(PRESETS[preset], vocab_size=97, max_seq_len=64)
            for name, preset in (("qwen3_5", "qwen3.5-debug"),
                                 ("qwen3_next", "qwen3-next-debug"),
                                 ("qwen3_5_moe", "qwen3.5-moe-debug"))}
_TP_SP = {"parallel.tp": 2, "parallel.sequence_parallel": True}
LAYOUTS = {**{name: ft.LAYOUTS[name] for name in ("fsdp_dp2", "lora_fsdp_dp2",
                                                  "fsdp_dp2_documents", "tp2_sp")},
           # tensor parallelism splits the linear layers' heads (their state with them)
           "tp2": (2, {"parallel.tp": 2}),
           "tp2_sp_documents": (2, {**_TP_SP, ft.DOCUMENTS: True})}
REFERENCE_OF = {name: "lora_single" if fields.get("lora.enabled") else
                "documents_single" if fields.get(ft.DOCUMENTS) else "single"
                for name, (_, fields) in LAYOUTS.items()}


def use_hybrid_family() -> None:
    """Point the shared worker at the hybrid family, its layouts and step count."""
    ft.FAMILIES, ft.LAYOUTS, ft.STEPS, ft.REFERENCE_OF = FAMILIES, LAYOUTS, STEPS, REFERENCE_OF


def _record(results: dict, key: str) -> dict:
    assert key in results, f"{key} did not run"
    assert "error" not in results[key], f"{key} failed:\n{results[key]['error']}"
    return results[key]


def check_layout(results: dict, out: Path, family: str, layout: str) -> None:
    """``layout``'s run of ``family`` against one process's: per-step loss and grad norm
    to 1e-5 (relative), final weights to 1e-4 (a hundredth of the lr). Measured at most:
    losses 1.0e-7, grad norms 9.1e-7 (Qwen3.5-MoE's LoRA), weights 5.0e-5 (the same)."""
    reference = REFERENCE_OF[layout]
    got = _record(results, f"{layout}/{family}")["history"]
    want = _record(results, f"{reference}/{family}")["history"]
    assert len(got) == len(want) == STEPS
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), 1):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"step {step}: loss {loss} vs {ref_loss}"
        assert norm == pytest.approx(ref_norm, rel=1e-5), \
            f"step {step}: grad norm {norm} vs {ref_norm}"
    weights = torch.load(out / f"{layout}-{family}.pt")
    ref_weights = torch.load(out / f"{reference}-{family}.pt")
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{key}: {m}")


if __name__ == "__main__":
    use_hybrid_family()
    ft.main(Path(sys.argv[1]))
