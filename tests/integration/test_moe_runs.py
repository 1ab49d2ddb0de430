"""A tiny Qwen3-MoE made by transformers (ChatML tokenizer and template) through the
trainer itself (``train.loop.train``): an SFT run with LoRA on the attention and the
experts, straight and stopped after step 2 then resumed (the same losses and the same
adapter bit for bit), whose exported adapter holds the experts' weights in peft's
target_parameters form and whose metrics carry the load-balancing loss and the expert
load; a DPO run and a GRPO run (its rollout through the one decoder) on the same model."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from helpers.grpo_prompts import grpo_overrides, sum_records, write_prompts
from helpers.hf_models import hf_model_dir
from helpers.preference_data import pairs, write_pairs
from lmforge.config import load_config
from lmforge.train import loop

pytestmark = [pytest.mark.slow, pytest.mark.long]  # make test-long (45 s), for make test's 15 min
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16,
           num_hidden_layers=2, hidden_size=64, norm_topk_prob=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hf_model_dir(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", "chatml", **MOE)


def _train(model, out, *overrides):
    cfg = load_config(None, [f"model.init_from={model}", f"train.output_dir={out}",
                             "train.device=cpu", "train.deterministic=true",
                             "train.progress_bar=false", "train.log_every=1",
                             "train.sample_tokens=1", "optim.warmup_steps=0", *overrides])
    return loop.train(cfg)


def _losses(out) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").open()) if "loss" in r]


def _sft(model, out, *extra):
    data = out.parent / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}.", "response": " ".join(
        str(n) for n in range(i % 7 + 2))}) + "\n" for i in range(40)))
    return _train(model, out, "data.kind=sft", f"data.path={data}", "data.seq_len=32",
                  "data.micro_batch_size=2", "data.global_batch_size=4",
                  "lora.enabled=true", "lora.rank=4", "lora.targets=all-linear",
                  "optim.lr=1e-2", "train.max_steps=4", "train.checkpoint_every=2", *extra)


def test_sft_lora_reaches_the_experts_resumes_exactly_and_logs_the_balance(model, tmp_path):
    _sft(model, tmp_path / "straight")
    _sft(model, tmp_path / "split", "train.stop_at_step=2")
    _sft(model, tmp_path / "split", "train.resume=auto")
    assert _losses(tmp_path / "split") == _losses(tmp_path / "straight")
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").open()]
    assert records[-1]["moe/aux_loss"] > 0 and records[-1]["moe/load_max_over_mean"] >= 1
    adapters = [load_file(tmp_path / run / "adapter" / "adapter_model.safetensors")
                for run in ("straight", "split")]
    assert adapters[0].keys() == adapters[1].keys()
    assert all((adapters[0][k] == adapters[1][k]).all() for k in adapters[0])
    assert any(".mlp.experts.lora_A." in k for k in adapters[0])  # down_proj's (peft nesting)
    assert any(".mlp.experts.base_layer.lora_A." in k for k in adapters[0])  # gate_up_proj's
    config = json.loads((tmp_path / "straight" / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_dpo_trains_an_moe_model(model, tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", pairs(16))
    _train(model, tmp_path / "dpo", "data.kind=preference", f"data.path={data}",
           "train.objective=dpo", "data.seq_len=48", "data.micro_batch_size=2",
           "data.global_batch_size=4", "train.max_steps=2", "train.save=false",
           "optim.lr=1e-3")
    records = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").open()]
    assert len(_losses(tmp_path / "dpo")) == 2 and "rewards/accuracies" in records[-1]
    assert "moe/aux_loss" in records[-1]


def test_grpo_trains_an_moe_model_through_the_one_decoder(model, tmp_path):
    data = write_prompts(tmp_path / "prompts.jsonl", sum_records(8))
    overrides = [o for o in grpo_overrides(model, data, 2) if not o.startswith("model.")]
    _train(model, tmp_path / "grpo", *overrides)
    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").open()]
    assert "reward" in records[-1] and "moe/aux_loss" in records[-1]
