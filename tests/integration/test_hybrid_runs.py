"""A tiny Qwen3.5 made by transformers (three Gated DeltaNet layers, then a full one;
ChatML tokenizer and template) through the trainer itself (``train.loop.train``): an SFT
run with LoRA on every linear (the DeltaNet's projections among them) over packed
documents, straight and stopped after step 2 then resumed (the same losses and adapter
bit for bit); a DPO run (LoRA) and a GRPO run (its rollout decoding through each linear layer's
recurrent state) that end finite, lower or level, and repeat themselves bit for bit;
bf16 and fp16 runs through their eval, export and end-of-run sample, whose export
``lmforge generate --dtype`` decodes in a batch."""
from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from helpers.grpo_prompts import grpo_overrides, sum_records, write_prompts
from helpers.hf_models import hf_model_dir
from helpers.preference_data import pairs, write_pairs
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.train import loop

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-long
HYBRID = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, head_dim=16,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_conv_kernel_dim=4)
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hf_model_dir(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5_text", "chatml",
                        **HYBRID)


def _train(model, out, *overrides):
    cfg = load_config(None, [f"model.init_from={model}", f"train.output_dir={out}",
                             "train.device=cpu", "train.deterministic=true",
                             "train.progress_bar=false", "train.log_every=1",
                             "train.sample_tokens=1", "optim.warmup_steps=0", *overrides])
    return loop.train(cfg)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def _losses(out) -> list[float]:
    return [r["loss"] for r in _records(out) if "loss" in r]


def _sft(model, out, *extra):
    data = out.parent / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}.", "response": " ".join(
        str(n) for n in range(i % 7 + 2))}) + "\n" for i in range(40)))
    return _train(model, out, "data.kind=sft", f"data.path={data}", "data.pack=true",
                  "data.seq_len=96", "data.micro_batch_size=2", "data.global_batch_size=4",
                  "lora.enabled=true", "lora.rank=4", "lora.targets=all-linear",
                  "optim.lr=1e-2", "train.max_steps=4", "train.checkpoint_every=2", *extra)


def test_sft_lora_on_packed_documents_resumes_exactly(model, tmp_path):
    """Each packed row restarts the DeltaNet's state per document; resuming from step 2
    gives the straight run's losses and adapter bit for bit, and the adapter is peft's,
    on the linear attention too."""
    _sft(model, tmp_path / "straight")
    _sft(model, tmp_path / "split", "train.stop_at_step=2")
    _sft(model, tmp_path / "split", "train.resume=auto")
    losses = _losses(tmp_path / "straight")
    assert len(losses) == 4 and all(map(math.isfinite, losses))
    assert _losses(tmp_path / "split") == losses
    adapters = [load_file(tmp_path / run / "adapter" / "adapter_model.safetensors")
                for run in ("straight", "split")]
    assert adapters[0].keys() == adapters[1].keys()
    assert all((adapters[0][k] == adapters[1][k]).all() for k in adapters[0])
    for name in LINEAR_ATTENTION:
        assert any(f".linear_attn.{name}.lora_A." in k for k in adapters[0]), name
    config = json.loads((tmp_path / "straight" / "adapter" / "adapter_config.json").read_text())
    assert set(LINEAR_ATTENTION) <= set(config["target_modules"])


def _dpo(model, out):
    data = write_pairs(out.parent / "pairs.jsonl", pairs(16))
    _train(model, out, "data.kind=preference", f"data.path={data}", "train.objective=dpo",
           "data.seq_len=48", "data.micro_batch_size=2", "data.global_batch_size=4",
           "train.max_steps=3", "train.save=false", "optim.lr=1e-3", "lora.enabled=true",
           "lora.rank=4", "lora.targets=all-linear")
    return _records(out)


def test_dpo_trains_a_hybrid_model_and_repeats_itself(model, tmp_path):
    """LoRA on every linear, the reference the base with the adapters switched off (the
    DeltaNet's too): three steps finite, from log 2 (the policy starts as its own
    reference) to a last loss no higher, and a second run the same bit for bit."""
    records = _dpo(model, tmp_path / "a")
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(map(math.isfinite, losses))
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4) and losses[-1] <= losses[0]
    assert "rewards/accuracies" in records[-1]
    assert [r["loss"] for r in _dpo(model, tmp_path / "b") if "loss" in r] == losses


def _grpo(model, out):
    data = write_prompts(out.parent / "prompts.jsonl", sum_records(8))
    overrides = [o for o in grpo_overrides(model, data, 3) if not o.startswith("model.")]
    _train(model, out, *overrides)
    return _records(out)


def test_grpo_rollout_decodes_through_the_recurrent_state_and_repeats_itself(model, tmp_path):
    """The rollout's completions come from the one decoder, each linear layer's
    GatedDeltaNetState carried token by token: rewards and losses finite, the same bit for
    bit in a second run."""
    records = _grpo(model, tmp_path / "a")
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in steps)
    again = [r for r in _grpo(model, tmp_path / "b") if "loss" in r]
    assert [(r["loss"], r["reward"]) for r in again] == [(r["loss"], r["reward"]) for r in steps]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_half_precision_run_ends_with_its_eval_and_sample_and_its_export_decodes(
        model, tmp_path, dtype, capsys):
    """Autocast on the CPU through the DeltaNet's fp32 recurrence (issue 44's failure
    was the end-of-run sample): the eval loss logged, the sample decoded, and the merged
    export decoded in a left-padded batch of 3 with the weights in ``dtype``."""
    out = tmp_path / "run"
    _sft(model, out, f"train.dtype={dtype}", "train.max_steps=2", "train.eval_every=2",
         "train.sample_tokens=8")
    assert "sample (8 tokens" in capsys.readouterr().out
    assert math.isfinite(_records(out)[-1]["eval_loss"])
    prompts = write_prompts(tmp_path / "p.jsonl", [
        {"prompt": "Count to 3."}, {"prompt": "x"}, {"prompt": "What is two plus two?"}])
    generated = tmp_path / "generated.jsonl"
    assert main(["generate", "--model", str(out / "hf"), "--prompts", str(prompts),
                 "--output", str(generated), "--batch-size", "3", "--greedy",
                 "--max-new-tokens", "8", "--dtype", dtype]) == 0
    assert len(generated.read_text().splitlines()) == 3
