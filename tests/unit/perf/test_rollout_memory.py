"""GRPO's rollout in the memory estimate (perf/rollout.py): its KV cache (prompts x
rl.num_generations rows x data.seq_len positions, the decoder's own bytes per token), the
prefill and the sampler's logits are a phase of the step, in the total when they are the
peak and on their own line always; the phase is within the estimate's 15% of the peak
measured while the decoder samples on the CPU; and a run that cannot fit is refused
naming rl.num_generations, rl.max_completion_length and data.micro_batch_size."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.config import load_config
from lmforge.models.common import materialize
from lmforge.models.generate import cache_bytes, generate
from lmforge.models.registry import build_model
from lmforge.models.sampling import Sampling
from lmforge.perf.budget import Budget, MemoryCheck, refusal
from lmforge.perf.estimate import estimate_memory, format_table, static_terms
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.perf.rollout import ROLLOUT, kv_cache_bytes_per_token, rollout_changes
from lmforge.perf.tracker import TensorMemoryTracker
from lmforge.perf.weights import stage_weights

TOLERANCE = 0.15  # the estimate's stated error (docs/estimate.md)
SEQ, COMPLETION = 64, 16


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n")
    return path


def _setup(prompts_file, *overrides, objective="grpo", args=None):
    """A tiny model's GRPO run (or the SFT run of as many rows) on the CPU."""
    model = [f"model.{k}={v}" for k, v in dataclasses.asdict(args).items()
             if k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
                      "max_seq_len")] if args else []
    grpo = ["train.objective=grpo", "data.kind=prompts", f"data.path={prompts_file}",
            "rl.rewards=length", f"rl.max_completion_length={COMPLETION}",
            "rl.num_generations=4"]
    kind = grpo if objective == "grpo" else ["data.kind=sft", f"data.path={prompts_file}"]
    cfg = load_config(None, ["model.preset=debug", *model, f"data.seq_len={SEQ}",
                             "train.device=cpu", *kind, *overrides])
    return setup_from_config(cfg, device="cpu", args=args)


def test_the_rollout_is_a_phase_of_prompts_x_generations_rows_of_seq_len_positions(
        prompts_file):
    setup = _setup(prompts_file, "data.micro_batch_size=2")
    est = estimate_memory(setup)
    rows = 2 * 4
    assert est.rollout["rollout KV cache"] == rows * SEQ * kv_cache_bytes_per_token(setup)
    static = sum(static_terms(setup, stage_weights(setup, 0)).values())
    assert est.phases[ROLLOUT] == pytest.approx(static + sum(est.rollout.values()))
    # the same rows as SFT: every training phase alike, the rollout phase besides
    sft = estimate_memory(_setup(prompts_file, f"data.micro_batch_size={rows}",
                                 objective="sft"))
    assert {k: v for k, v in est.phases.items() if k != ROLLOUT} == pytest.approx(sft.phases)
    assert est.total_bytes >= sft.total_bytes
    line = [s for s in format_table(est).splitlines() if s.startswith("rollout:")]
    assert len(line) == 1 and "rl.num_generations 4" in line[0] and "KV cache" in line[0]
    assert set(est.as_dict()["rollout_gib"]) == set(est.rollout)


def test_a_rollout_larger_than_the_step_is_the_estimates_peak_and_adds_to_sfts_total(
        prompts_file):
    """Many layers, fully checkpointed, keys and values as wide as the model, a small
    vocabulary: the cache outweighs what training keeps, and the total is the static
    terms plus the rollout's own."""
    args = tiny_llama_args(dim=64, n_layers=24, n_heads=4, n_kv_heads=4, vocab_size=64,
                           ffn_dim=128, max_seq_len=SEQ)
    overrides = ("train.activation_checkpointing=full", "data.micro_batch_size=2")
    setup = _setup(prompts_file, *overrides, args=args)
    est = estimate_memory(setup)
    assert est.phase == ROLLOUT
    static = sum(static_terms(setup, stage_weights(setup, 0)).values())
    assert est.peak_bytes == pytest.approx(static + sum(est.rollout.values()))
    sft = estimate_memory(_setup(prompts_file, "train.activation_checkpointing=full",
                                 "data.micro_batch_size=8", objective="sft", args=args))
    assert est.total_bytes > sft.total_bytes
    assert est.peak_bytes - sft.peak_bytes < sum(est.rollout.values())


@pytest.mark.parametrize("top_p, vocab", [(1.0, 256), (0.9, 8192)])
def test_the_rollout_phase_is_within_15_percent_of_the_measured_decode(prompts_file, top_p,
                                                                       vocab):
    """The decoder samples 2 prompts x 4 completions of prompts as long as data.seq_len -
    rl.max_completion_length allows, on the CPU; the live tensors' peak (weights, cache,
    prefill, sampler) against the weights plus the rollout's terms."""
    args = tiny_llama_args(dim=64, vocab_size=vocab, ffn_dim=176, max_seq_len=SEQ)
    torch.manual_seed(0)
    model = materialize(build_model(args), "cpu")
    model.eval()
    prompts = [torch.randint(3, vocab, (SEQ - COMPLETION,)).tolist() for _ in range(2)]
    rows = [p for p in prompts for _ in range(4)]
    tracker = TensorMemoryTracker()
    tracker.track(model.parameters())
    with tracker:
        out = generate(model, rows, COMPLETION, Sampling(temperature=1.0, top_p=top_p),
                       seeds=list(range(len(rows))))
    assert max(len(c.ids) for c in out) == COMPLETION  # (no stop id: every row runs on)
    setup = _setup(prompts_file, "data.micro_batch_size=2", f"rl.top_p={top_p}", args=args)
    est = estimate_memory(setup)
    weights = stage_weights(setup, 0)
    estimated = weights.trainable_bytes + weights.frozen_bytes + sum(est.rollout.values())
    assert est.rollout["rollout KV cache"] == cache_bytes(model, len(rows), SEQ)
    error = estimated / tracker.peak - 1
    assert abs(error) <= TOLERANCE, (f"estimate {estimated / 2**20:.3f} MiB vs measured "
                                     f"{tracker.peak / 2**20:.3f} MiB ({error:+.1%})")


def test_a_grpo_run_that_cannot_fit_is_refused_naming_the_rollouts_keys(prompts_file):
    setup = _setup(prompts_file, "data.micro_batch_size=8", "rl.num_generations=16",
                   f"rl.max_completion_length={SEQ // 2}")
    need = estimate_memory(setup).total_bytes
    check = MemoryCheck(need, "cpu", Budget(need / 4, "a small host"))
    assert not check.fits
    line = refusal(setup.job, check)
    assert "rl.num_generations=8 (" in line
    assert f"rl.max_completion_length={SEQ // 4} with data.seq_len={SEQ - SEQ // 4} (" in line
    assert "data.micro_batch_size=1 (" in line


def test_the_rollouts_changes_keep_the_prompts_room_and_a_group_of_two(prompts_file):
    cfg = _setup(prompts_file, "rl.num_generations=3").cfg
    changes = dict(rollout_changes(cfg))
    assert changes == {"rl.num_generations=2": {"rl.num_generations": 2},
                       f"rl.max_completion_length={COMPLETION // 2} with data.seq_len="
                       f"{SEQ - COMPLETION // 2}": {"rl.max_completion_length": COMPLETION // 2,
                                                    "data.seq_len": SEQ - COMPLETION // 2}}
    assert rollout_changes(_setup(prompts_file, objective="sft").cfg) == []
