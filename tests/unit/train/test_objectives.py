"""The step minimises what its objective object says: the trainer's model carries the
job's objective, the step calls it per micro-batch (and a pipeline's last stage per
microbatch), so a new loss is a new object, not a branch in the loop."""
from dataclasses import dataclass

import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.config import JobConfig
from lmforge.models.llama import build_llama, materialize
from lmforge.models.loss import micro_batch_loss_sum
from lmforge.job import resolve
from lmforge.train.model_setup import build_train_model
from lmforge.train.objectives import NEXT_TOKEN, objective_for
from lmforge.train.step import accumulate_gradients

ARGS = tiny_llama_args(vocab_size=61)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ARGS.vocab_size, (2, 10), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def _model():
    torch.manual_seed(0)
    return materialize(build_llama(ARGS), "cpu")


@dataclass(frozen=True)
class Doubled:
    """A stand-in for a new objective: twice the next-token loss."""
    name: str = "doubled"

    def count(self, batch):
        return NEXT_TOKEN.count(batch)

    def loss_sum(self, model, batch, device, autocast, loss_chunk_tokens=0, stats=None):
        return 2 * NEXT_TOKEN.loss_sum(model, batch, device, autocast, loss_chunk_tokens)

    def stage_loss_sum(self, logits, labels):
        return 2 * NEXT_TOKEN.stage_loss_sum(logits, labels)


def test_next_token_is_every_non_preference_jobs_objective_and_sums_labelled_tokens():
    assert objective_for(resolve(JobConfig())) is NEXT_TOKEN
    model, batch = _model(), _batch()
    with torch.no_grad():
        assert torch.equal(NEXT_TOKEN.loss_sum(model, batch, torch.device("cpu")),
                           micro_batch_loss_sum(model, batch, torch.device("cpu")))


def test_the_step_calls_the_objective_it_is_given():
    cpu, batch = torch.device("cpu"), _batch()
    plain = accumulate_gradients(_model(), [batch], cpu)
    doubled_model = _model()
    doubled = accumulate_gradients(doubled_model, [batch], cpu, objective=Doubled())
    torch.testing.assert_close(doubled, 2 * plain)
    plain_model = _model()
    accumulate_gradients(plain_model, [batch], cpu)
    for (name, p), q in zip(doubled_model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, msg=name)


def test_the_trainers_model_carries_the_jobs_objective():
    cfg = JobConfig()
    cfg.data.seq_len = ARGS.max_seq_len
    job = resolve(cfg, args=ARGS)
    model = build_train_model(job, torch.device("cpu"))
    assert model.objective is objective_for(job)
    model.objective = Doubled()
    batch = _batch()
    n_valid = int(batch["labels"].numel())
    loss = model.forward_backward([batch], n_valid, torch.device("cpu"),
                                  autocast=lambda: torch.autocast("cpu", enabled=False))
    with torch.no_grad():
        reference = 2 * micro_batch_loss_sum(model.parts[0], batch, torch.device("cpu"))
    torch.testing.assert_close(loss, reference / n_valid)
