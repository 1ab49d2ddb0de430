"""The preference objective in the trainer: packed pairs give the unpacked loss and
gradients, a LoRA run's reference (its model with the adapters off) is the base model's,
and a run whose reference is precomputed trains as one with a live frozen copy."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers.preference_data import model_dir, pairs, write_pairs
from lmforge.config import LoraConfig, load_config
from lmforge.data.preference import PreferenceDataset
from lmforge.data.tokenizer import load_tokenizer
from lmforge.models.hf import load_hf_model
from lmforge.models.preference import PreferenceParams
from lmforge.peft import apply_lora, lora_layers
from lmforge.train.loop import train
from lmforge.models.preference import sequence_logps
from lmforge.train.preference import Preference
from lmforge.train.step import accumulate_gradients

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref-objective")
    model = model_dir(root)
    data = write_pairs(root / "pairs.jsonl", pairs(24))
    return model, data, root


def _datasets(setup):
    model, data, root = setup
    tok = load_tokenizer(model)
    return [PreferenceDataset(data, tok, "auto", 48, cache_dir=root / "cache", pack=pack)
            for pack in (False, True)]


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo"])
def test_packed_pairs_give_the_unpacked_loss_and_gradients(setup, name):
    plain, packed = _datasets(setup)
    batch = packed.batch([0, 1])
    order = batch["sample_ids"].tolist()
    policy = load_hf_model(setup[0])
    reference = copy.deepcopy(policy).requires_grad_(False)
    objective = Preference(name, PreferenceParams(beta=0.2), "model", reference)
    grads, losses = [], []
    for b in (batch, plain.pair_batch(order)):
        policy.zero_grad()
        losses.append(accumulate_gradients(policy, [b], CPU, objective=objective))
        grads.append([p.grad.clone() for p in policy.parameters()])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    # fp32 sums in another order (a packed row's attention and matmul shapes differ):
    # one element in 25,664 differs by 1.07e-6
    for g_packed, g_plain in zip(*grads):
        torch.testing.assert_close(g_packed, g_plain, rtol=1e-5, atol=2e-6)


def test_chunked_log_probabilities_give_the_whole_batchs_loss_and_gradients(setup):
    plain, _ = _datasets(setup)
    batch = plain.pair_batch([0, 2, 7])
    policy = load_hf_model(setup[0])
    objective = Preference("dpo", PreferenceParams(beta=0.2), "model",
                           copy.deepcopy(policy).requires_grad_(False))
    grads, losses = [], []
    for chunk in (0, 16):
        policy.zero_grad()
        losses.append(accumulate_gradients(policy, [batch], CPU, objective=objective,
                                           loss_chunk_tokens=chunk))
        grads.append([p.grad.clone() for p in policy.parameters()])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for whole, chunked in zip(*grads):
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=2e-6)


def test_the_lora_reference_is_the_base_model_with_no_second_copy(setup):
    plain, _ = _datasets(setup)
    batch = plain.pair_batch([0, 3, 5])
    base = load_hf_model(setup[0]).eval()
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(enabled=True, rank=4, targets="all-linear"))
    g = torch.Generator().manual_seed(0)
    for layer in lora_layers(model).values():  # adapters that change the logits
        layer.lora_b.data = torch.randn(layer.lora_b.shape, generator=g) * 0.3
    params = PreferenceParams()
    off = Preference("dpo", params, "adapters_off").reference_logps(model, batch, CPU)
    copied = Preference("dpo", params, "model", base).reference_logps(model, batch, CPU)
    torch.testing.assert_close(off.chosen, copied.chosen, rtol=0, atol=1e-6)
    torch.testing.assert_close(off.rejected, copied.rejected, rtol=0, atol=1e-6)
    with torch.no_grad():
        adapted = sequence_logps(model, batch, CPU)
    assert (adapted.chosen - off.chosen).abs().max() > 1e-3  # the adapters were on again


def test_a_precomputed_reference_trains_as_a_live_frozen_copy(setup, tmp_path):
    model, data, _ = setup
    history = {}
    for ref in ("live", "precomputed"):
        out = tmp_path / ref
        cfg = load_config(None, [f"model.init_from={model}", "data.kind=preference",
                                 f"data.path={data}", "data.seq_len=48",
                                 "data.micro_batch_size=4", "train.max_steps=3",
                                 "train.log_every=1", "train.eval_every=3", "train.save=false",
                                 f"train.output_dir={out}", f"train.reference={ref}",
                                 "optim.lr=1e-3", "train.device=cpu"])
        train(cfg)
        history[ref] = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert (tmp_path / "precomputed" / "reference").is_dir()
    for live, pre in zip(history["live"], history["precomputed"]):
        for key in ("loss", "rewards/chosen", "rewards/margins", "eval_loss"):
            if key in live:
                assert pre[key] == pytest.approx(live[key], rel=1e-5, abs=1e-6), key
