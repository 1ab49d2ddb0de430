"""The preference objectives equal TRL's (the ``trl`` package) on a tiny model built by
transformers and the same token ids, fp32 on the CPU: per-sample log-probabilities, the
loss and the six reward metrics to 1e-5, and the losses of 3 AdamW steps to 1e-4.

How the comparison is made:
- DPO (sigmoid) and IPO: TRL's own trainer loss, ``DPOTrainer._compute_loss``, on the
  padded rows with their completion mask, the reference log-probabilities given as its
  precomputed-reference path takes them (``ref_chosen_logps`` / ``ref_rejected_logps``);
  its metrics are what it logs (``_metrics["train"]``).
- SimPO: TRL's ``CPOTrainer`` functions with ``loss_type="simpo"`` and ``cpo_alpha=0``
  (pure SimPO): ``get_batch_logps`` (averaged) on transformers' logits, then ``cpo_loss``.
- 3 optimizer steps: the same AdamW (lr 1e-2) on transformers' model through TRL's loss
  and on ours through lmforge's, each step's loss compared.
- ORPO: TRL's ``ORPOTrainer.get_batch_logps`` and ``odds_ratio_loss``; its NLL term is
  compared per pair, each chosen completion's mean token loss (TRL averages it over all
  the chosen tokens of a micro-batch, and over the prompt too: ours follows the paper's
  Eq. 6 and trains completions only, see ``models.preference.orpo``).
"""
from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F

from helpers.hf_models import load_reference, random_hf_causal_lm
from lmforge import IGNORE_INDEX
from lmforge.models.hf import load_hf_model
from lmforge.models.preference import (METRICS, PairLogps, PreferenceParams, preference_loss,
                                       sequence_logps)

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

CPU = torch.device("cpu")
PROMPTS, CHOSEN, REJECTED = (5, 3, 7), (4, 6, 2), (3, 5, 6)  # tokens of each pair's parts
PARAMS = PreferenceParams(beta=0.3, gamma=0.4, lam=0.2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("pref-model")
    random_hf_causal_lm("llama", seed=4).float().save_pretrained(path)
    return path


@pytest.fixture
def models(model_path):
    """(transformers' model, ours), both loaded from the same directory, fresh per test
    (TRL's trainer changes the model it is given)."""
    return load_reference(model_path).requires_grad_(True), load_hf_model(model_path)


def rows(vocab: int):
    """TRL's padded rows (chosen 0..n-1, then rejected) with their attention and
    completion masks, and our batch of the same tokens (labels on completions only)."""
    g = torch.Generator().manual_seed(7)
    sequences = []
    for completions in (CHOSEN, REJECTED):
        for p, c in zip(PROMPTS, completions):
            prompt = torch.randint(1, vocab, (p,), generator=g)
            sequences.append((prompt, torch.randint(1, vocab, (c,), generator=g)))
    width = max(len(p) + len(c) for p, c in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for r, (p, c) in enumerate(sequences):
        n = len(p) + len(c)
        ids[r, :n] = torch.cat([p, c])
        attention[r, :n] = 1
        completion[r, len(p):n] = 1
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(completion[:, 1:].bool(), ids[:, 1:], IGNORE_INDEX)
    slots = torch.where(labels != IGNORE_INDEX, torch.arange(len(ids))[:, None], -1)
    ours = {"input_ids": ids, "labels": labels, "slots": slots, "n_pairs": len(PROMPTS)}
    theirs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    return ours, theirs


REF = PairLogps(torch.tensor([-30.0, -41.0, -12.5]), torch.tensor([-22.0, -35.5, -40.0]),
                torch.ones(3), torch.ones(3))


def dpo_trainer(hf, loss_type: str, tmp_path):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    import tokenizers

    vocab = {"[PAD]": 0, "a": 1, "[UNK]": 2}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "[UNK]")),
        pad_token="[PAD]", eos_token="[PAD]")
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], beta=PARAMS.beta,
                         loss_type=[loss_type], use_cpu=True, logging_steps=1)
    data = Dataset.from_dict({"prompt": ["a"], "chosen": ["a"], "rejected": ["a a"]})
    trainer = trl.DPOTrainer(model=hf, ref_model=copy.deepcopy(hf), args=args,
                             train_dataset=data, processing_class=tok)
    trainer.precompute_ref_logps = True  # the reference comes with the inputs
    return trainer


def trl_dpo(trainer, hf, theirs) -> tuple[torch.Tensor, dict]:
    trainer._metrics["train"].clear()
    inputs = {**theirs, "ref_chosen_logps": REF.chosen, "ref_rejected_logps": REF.rejected}
    hf.train()
    loss = trainer._compute_loss(hf, inputs, return_outputs=False)
    return loss, {name: trainer._metrics["train"][name][-1] for name in METRICS}


@pytest.mark.parametrize("objective,loss_type", [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_dpo_and_ipo_equal_trls_trainer_loss_and_metrics(models, tmp_path, objective,
                                                         loss_type):
    hf, ours_model = models
    ours, theirs = rows(hf.config.vocab_size)
    trainer = dpo_trainer(hf, loss_type, tmp_path)
    their_loss, their_metrics = trl_dpo(trainer, hf, theirs)
    policy = sequence_logps(ours_model, ours, CPU)
    loss, metrics = preference_loss(objective, policy, REF, PARAMS)
    torch.testing.assert_close(loss.mean(), their_loss.detach(), rtol=1e-5, atol=1e-5)
    for name in METRICS:
        assert float(metrics[name].mean()) == pytest.approx(their_metrics[name], abs=1e-5,
                                                            rel=1e-5), name


def _trl_reference_free(objective: str, hf, theirs) -> torch.Tensor:
    """TRL's SimPO (CPOTrainer) or ORPO (ORPOTrainer, NLL per pair) loss, with grad."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    logits = hf(input_ids=theirs["input_ids"], attention_mask=theirs["attention_mask"]).logits
    labels, n = _their_labels(theirs), len(PROMPTS)
    avg = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    device = types.SimpleNamespace(device=CPU)
    if objective == "simpo":
        fake = types.SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=PARAMS.gamma,
                                     beta=PARAMS.beta, label_smoothing=0.0, accelerator=device)
        return CPOTrainer.cpo_loss(fake, avg[:n], avg[n:])[0].mean()
    fake = types.SimpleNamespace(beta=PARAMS.lam, accelerator=device)
    ratio = ORPOTrainer.odds_ratio_loss(fake, avg[:n], avg[n:])[0]
    nll = torch.stack([F.cross_entropy(logits[i, :-1], labels[i, 1:]) for i in range(n)])
    return (nll - ratio).mean()


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo"])
def test_losses_stay_equal_to_trls_over_three_adamw_steps(models, tmp_path, objective):
    hf, ours_model = models
    ours, theirs = rows(hf.config.vocab_size)
    trainer = (dpo_trainer(hf, "sigmoid" if objective == "dpo" else "ipo", tmp_path)
               if objective in ("dpo", "ipo") else None)
    opt_theirs = torch.optim.AdamW(hf.parameters(), lr=1e-2, weight_decay=0.0)
    opt_ours = torch.optim.AdamW(ours_model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        hf.train()
        their_loss = (trl_dpo(trainer, hf, theirs)[0] if trainer is not None else
                      _trl_reference_free(objective, hf, theirs))
        reference = REF if trainer is not None else None
        loss, _ = preference_loss(objective, sequence_logps(ours_model, ours, CPU), reference,
                                  PARAMS)
        loss = loss.mean()
        assert float(loss) == pytest.approx(float(their_loss), abs=1e-4, rel=1e-4)
        for opt, value in ((opt_theirs, their_loss), (opt_ours, loss)):
            opt.zero_grad()
            value.backward()
            opt.step()


def _logits(hf, theirs):
    with torch.no_grad():
        return hf(input_ids=theirs["input_ids"],
                  attention_mask=theirs["attention_mask"]).logits


def _their_labels(theirs):
    return theirs["input_ids"].masked_fill(theirs["completion_mask"] == 0, IGNORE_INDEX)


def test_simpo_equals_trls_cpo_loss_with_loss_type_simpo(models):
    from trl.experimental.cpo import CPOTrainer

    hf, ours_model = models
    ours, theirs = rows(hf.config.vocab_size)
    avg = CPOTrainer.get_batch_logps(_logits(hf, theirs), _their_labels(theirs),
                                     average_log_prob=True)
    n = len(PROMPTS)
    fake = types.SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=PARAMS.gamma,
                                 beta=PARAMS.beta, label_smoothing=0.0,
                                 accelerator=types.SimpleNamespace(device=CPU))
    their_losses, their_chosen, their_rejected = CPOTrainer.cpo_loss(fake, avg[:n], avg[n:])
    with torch.no_grad():
        loss, metrics = preference_loss("simpo", sequence_logps(ours_model, ours, CPU), None,
                                        PARAMS)
    torch.testing.assert_close(loss, their_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/chosen"], their_chosen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/rejected"], their_rejected, rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(metrics["logps/chosen"], avg[:n], rtol=1e-5, atol=1e-5)


def test_orpo_equals_trls_odds_ratio_loss_and_its_nll_per_pair(models):
    from trl.experimental.orpo import ORPOTrainer

    hf, ours_model = models
    ours, theirs = rows(hf.config.vocab_size)
    logits, labels = _logits(hf, theirs), _their_labels(theirs)
    avg = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    n = len(PROMPTS)
    fake = types.SimpleNamespace(beta=PARAMS.lam, accelerator=types.SimpleNamespace(device=CPU))
    ratio_losses, their_chosen, their_rejected, _, _ = ORPOTrainer.odds_ratio_loss(
        fake, avg[:n], avg[n:])
    nll = torch.stack([F.cross_entropy(logits[i, :-1], labels[i, 1:]) for i in range(n)])
    with torch.no_grad():
        loss, metrics = preference_loss("orpo", sequence_logps(ours_model, ours, CPU), None,
                                        PARAMS)
    torch.testing.assert_close(loss, nll - ratio_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["nll_loss"], nll, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/chosen"], their_chosen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["rewards/rejected"], their_rejected, rtol=1e-5,
                               atol=1e-5)
