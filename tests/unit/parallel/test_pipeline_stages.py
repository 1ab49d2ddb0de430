"""Pipeline stages of a tied model (the head's weight is the embedding's): the first and
the last stage each hold the weight under the whole model's names, and the sum of their
gradients is the whole model's gradient. One process, the stages run by hand."""
import pytest
import torch
import torch.nn.functional as F

from helpers.tiny_models import tiny_llama_args
from lmforge.checkpoint.state import collect_state
from lmforge.config import OptimConfig
from lmforge.models.llama import build_llama, materialize
from lmforge.parallel.pipeline import split_model
from lmforge.train.optim import build_optimizer

ARGS = tiny_llama_args(n_layers=4, tie_embeddings=True)


def _whole_and_stages(pp: int, virtual: int):
    torch.manual_seed(0)
    whole = materialize(build_llama(ARGS), "cpu")
    stages = []
    for rank in range(pp):
        for index, part in split_model(build_llama(ARGS), rank, pp, virtual):
            materialize(part, "cpu", init=False)
            part.load_state_dict({k: whole.state_dict()[k] for k in part.state_dict()})
            stages.append((index, part))
    return whole, [part for _, part in sorted(stages, key=lambda s: s[0])]


def _keys(model) -> set:
    optimizer = build_optimizer(model, OptimConfig())
    state, _ = collect_state(model, optimizer)
    return set(state["model"]) | {f"optimizer.{k}" for k in state["optimizer"]}


@pytest.mark.parametrize("pp, virtual", [(2, 1), (2, 2)])
def test_tied_stages_use_the_whole_models_names_so_checkpoints_reshard(pp, virtual):
    whole, stages = _whole_and_stages(pp, virtual)
    first, last = stages[0], stages[-1]
    assert last.output.weight is last.tok_embeddings.weight and first.output is None
    assert set().union(*(_keys(stage) for stage in stages)) == _keys(whole)


def test_tied_stages_forward_like_the_whole_model_and_their_gradients_sum_to_its():
    whole, (first, last) = _whole_and_stages(2, 1)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))

    def loss_of(logits):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    loss_of(whole(tokens)).backward()
    hidden = first(tokens)
    received = hidden.detach().requires_grad_()  # what the last stage receives
    loss = loss_of(last(received))
    loss.backward()
    hidden.backward(received.grad)
    torch.testing.assert_close(loss, loss_of(whole(tokens)))
    summed = first.tok_embeddings.weight.grad + last.tok_embeddings.weight.grad
    torch.testing.assert_close(summed, whole.tok_embeddings.weight.grad)


def test_a_tied_first_stage_initialises_its_embedding_as_the_head_it_also_is():
    """Models too large for a whole-model copy initialise each stage in place; the first
    stage's copy of a tied weight must be drawn as the head's (it is broadcast to the
    last stage), not as an untied embedding's unit scale."""
    torch.manual_seed(0)
    (_, first), = split_model(build_llama(ARGS), 0, 2, 1)
    materialize(first, "cpu")
    assert float(first.tok_embeddings.weight.std()) == pytest.approx(ARGS.init_std, rel=0.1)
