"""train.fused_loss: the fused linear + cross-entropy gives the plain loss's values and
gradients (fp32, CPU, to 1e-5) for every objective that reads the head: the summed
next-token loss, the preference objectives' sequence log-probabilities, GRPO's per-token
log-probabilities and entropy; and its peak memory holds no (tokens x vocab) tensor."""
import contextlib
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.tiny_models import tiny_family_args
from lmforge import IGNORE_INDEX
from lmforge.config import ConfigError, JobConfig, validate
from lmforge.eval.evaluate import evaluate
from lmforge.models.common import materialize
from lmforge.models.fused_loss import FusedLossError, fused_loss_sum, fused_token_logps
from lmforge.models.loss import fused_label_logps, model_inputs
from lmforge.models.preference import PreferenceParams
from lmforge.models.registry import build_model
from lmforge.peft.lora import LoraLinear
from lmforge.perf.tracker import TensorMemoryTracker
from lmforge.train.grpo import label_logps
from lmforge.train.preference import Preference
from lmforge.train.step import accumulate_gradients

CPU = torch.device("cpu")
FAMILIES = tiny_family_args()  # (GPT-J's head has a bias)
ARGS = FAMILIES["llama"]
CLOSE = dict(rtol=1e-5, atol=1e-6)


def _model(args=ARGS, tie=False, fused=False, seed=0):
    torch.manual_seed(seed)
    args = type(args)(**{**args.__dict__, "tie_embeddings": tie})
    model = materialize(build_model(args), "cpu")
    model.fused_loss = fused  # (what build_train_model sets from train.fused_loss)
    return model


def _batches(vocab: int, rows=3, seq=20, n=2):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        labels = torch.randint(0, vocab, (rows, seq), generator=g)
        labels[0, 5:] = IGNORE_INDEX  # padding, and a chunk with no label at all
        labels[1, :3] = IGNORE_INDEX  # a masked prompt
        out.append({"input_ids": torch.randint(0, vocab, (rows, seq), generator=g),
                    "labels": labels})
    return out


def _assert_same_gradients(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **CLOSE, msg=name)


# ------------------------------------------------------------------ the functions alone

def _head(bias: bool, vocab=53, dim=16):
    torch.manual_seed(3)
    return nn.Linear(dim, vocab, bias=bias)


def _inputs(vocab=53, dim=16, tokens=37):
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(tokens, dim, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::5] = IGNORE_INDEX
    return hidden, labels


def _grads(value, hidden, head):
    return torch.autograd.grad(value, [hidden, *head.parameters()])


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])  # a token, uneven, whole, larger
def test_fused_loss_sum_equals_cross_entropy_with_its_hidden_and_weight_gradients(bias, chunk):
    head, (hidden, labels) = _head(bias), _inputs()
    plain = F.cross_entropy(head(hidden), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    fused = fused_loss_sum(head, hidden, labels, chunk)
    torch.testing.assert_close(fused, plain, **CLOSE)
    # backward scales the gradients made in forward by the upstream gradient
    for got, want in zip(_grads(fused * 1.7, hidden, head), _grads(plain * 1.7, hidden, head)):
        torch.testing.assert_close(got, want, **CLOSE)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_token_logps_take_any_per_token_gradient(bias, temperature):
    head, (hidden, labels) = _head(bias), _inputs()
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(5))
    want, want_entropy = label_logps(head(hidden), labels, temperature)
    got, entropy = fused_token_logps(head, hidden, labels, 8, scale=1 / temperature,
                                     entropy=True)
    torch.testing.assert_close(got, want, **CLOSE)
    torch.testing.assert_close(entropy, want_entropy, **CLOSE)
    assert not entropy.requires_grad  # (a metric)
    for g, w in zip(_grads((got * weights).sum(), hidden, head),
                    _grads((want * weights).sum(), hidden, head)):
        torch.testing.assert_close(g, w, **CLOSE)


def test_a_frozen_head_gets_no_gradient_and_only_the_hidden_states_do():
    head, (hidden, labels) = _head(True), _inputs()
    head.requires_grad_(False)  # (LoRA: the head is never a target)
    plain = F.cross_entropy(head(hidden), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    for loss in (fused_loss_sum(head, hidden, labels, 8),
                 -fused_token_logps(head, hidden, labels, 8).sum()):
        got, = torch.autograd.grad(loss, [hidden])
        torch.testing.assert_close(got, torch.autograd.grad(plain, [hidden],
                                                            retain_graph=True)[0], **CLOSE)


def test_a_head_that_is_not_a_plain_linear_layer_is_refused_naming_the_key():
    # (lmforge never puts LoRA on the head: peft/targets.py; this guards the assumption)
    head, (hidden, labels) = LoraLinear(16, 53, rank=2, alpha=4), _inputs()
    with pytest.raises(FusedLossError, match="train.fused_loss.*LoraLinear"):
        fused_loss_sum(head, hidden, labels)


# ------------------------------------------------------------------ the trainer's paths

@pytest.mark.parametrize("family, tie", [("llama", False), ("llama", True), ("gptj", False)],
                         ids=["llama-untied", "llama-tied", "gptj-head-bias"])
@pytest.mark.parametrize("chunk", [0, 7, 1000])  # the default, uneven, larger than all
def test_next_token_training_gives_the_plain_loss_and_gradients(family, tie, chunk):
    args, batches = FAMILIES[family], _batches(FAMILIES[family].vocab_size)
    plain = _model(args, tie)
    ref = accumulate_gradients(plain, batches, CPU)
    fused = _model(args, tie, fused=True)
    loss = accumulate_gradients(fused, batches, CPU, loss_chunk_tokens=chunk)
    torch.testing.assert_close(loss, ref, **CLOSE)
    _assert_same_gradients(fused, plain)


def test_evaluation_without_gradients_gives_the_plain_loss():
    batches = _batches(ARGS.vocab_size)
    assert evaluate(_model(fused=True), batches, CPU) == pytest.approx(
        evaluate(_model(), batches, CPU), rel=1e-6)


def test_bf16_autocast_follows_the_plain_loss_closely():
    batches = _batches(ARGS.vocab_size)
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    ref = accumulate_gradients(_model(), batches, CPU, autocast)
    loss = accumulate_gradients(_model(fused=True), batches, CPU, autocast,
                                loss_chunk_tokens=16)
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=0)


def _pair_batch(vocab: int, pairs=2, seq=12):
    """``pairs`` chosen rows then as many rejected ones, each prompt's 4 tokens masked."""
    g = torch.Generator().manual_seed(6)
    rows = 2 * pairs
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[:, :4] = IGNORE_INDEX
    labels[1, 9:] = IGNORE_INDEX  # a shorter completion
    slots = torch.arange(rows).unsqueeze(1).expand(rows, seq).clone()
    slots[labels == IGNORE_INDEX] = -1
    return {"input_ids": torch.randint(0, vocab, (rows, seq), generator=g),
            "labels": labels, "slots": slots, "n_pairs": pairs}


@pytest.mark.parametrize("name", ["dpo", "simpo"])
def test_preference_objectives_give_the_plain_loss_and_gradients(name):
    batch = _pair_batch(ARGS.vocab_size)
    losses, models = [], []
    for fused in (False, True):
        model = _model(tie=True, fused=fused)
        reference = copy.deepcopy(_model(tie=True, seed=1)).requires_grad_(False)
        objective = Preference(name, PreferenceParams(beta=0.2), "model", reference)
        losses.append(accumulate_gradients(model, [batch], CPU, objective=objective,
                                           loss_chunk_tokens=5))
        models.append(model)
    torch.testing.assert_close(losses[1], losses[0], **CLOSE)
    _assert_same_gradients(models[1], models[0])


def test_grpo_token_logps_and_entropy_equal_the_plain_heads():
    batch = _batches(ARGS.vocab_size, n=1)[0]
    weights = torch.randn(batch["labels"].shape, generator=torch.Generator().manual_seed(7))
    plain, fused = _model(fused=False), _model(fused=True)
    want, want_entropy = label_logps(plain(**model_inputs(batch, CPU)), batch["labels"], 0.8)
    got, entropy = fused_label_logps(fused, batch, CPU, contextlib.nullcontext, 0.8,
                                     chunk_tokens=6)
    torch.testing.assert_close(got, want, **CLOSE)
    torch.testing.assert_close(entropy, want_entropy, **CLOSE)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    _assert_same_gradients(fused, plain)


# ------------------------------------------------------------------ memory

def _peak_bytes(vocab: int, rows: int, fused: bool, per_token: bool = False) -> int:
    """Peak live tensor bytes of one forward + backward of a tiny Llama (the parameters,
    the batch and the gradients included), for the summed loss or, ``per_token``, the
    per-token log-probabilities under a per-token gradient."""
    args = type(ARGS)(**{**ARGS.__dict__, "vocab_size": vocab})
    model = _model(args, fused=fused)
    batch = _batches(vocab, rows=rows, seq=64, n=1)[0]
    tracker = TensorMemoryTracker()
    tracker.track(list(model.parameters()) + [batch["input_ids"], batch["labels"]])
    with tracker:
        if per_token:
            hidden = model(**model_inputs(batch, CPU), head=False)
            if fused:
                logps = fused_token_logps(model.output, hidden, batch["labels"], 32)
            else:
                logps = label_logps(model.output(hidden), batch["labels"], 1.0)[0]
            (logps * 0.5).sum().backward()
        else:
            accumulate_gradients(model, [batch], CPU, loss_chunk_tokens=32 if fused else 0)
    return tracker.peak


def _tokens_x_vocab_bytes(fused: bool, per_token: bool) -> float:
    """The peak's term in tokens x vocabulary, in bytes per (token, logit): how much more
    adding 256 tokens raises the peak at a vocabulary of 16,000 than at one of 8,000."""
    growth = {vocab: _peak_bytes(vocab, 8, fused, per_token)
              - _peak_bytes(vocab, 4, fused, per_token) for vocab in (8000, 16000)}
    return (growth[16000] - growth[8000]) / (4 * 64 * 8000)


@pytest.mark.parametrize("per_token", [False, True], ids=["loss-sum", "per-token"])
def test_the_fused_peak_does_not_grow_with_tokens_times_vocabulary(per_token):
    # the plain head keeps fp32 logits and their log-softmax (4 bytes each) at least;
    # the fused head one chunk's, whatever the micro-batch
    assert _tokens_x_vocab_bytes(False, per_token) >= 8
    assert abs(_tokens_x_vocab_bytes(True, per_token)) < 0.01


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"])
def test_fused_loss_is_refused_with_tensor_or_pipeline_parallelism(layout):
    cfg = JobConfig()
    cfg.train.fused_loss = True
    section, value = layout.split("=")
    setattr(cfg.parallel, section.split(".")[1], int(value))
    cfg.model.n_layers, cfg.model.tie_embeddings = 4, False
    with pytest.raises(ConfigError, match="train.fused_loss"):
        validate(cfg, world_size=2)


def test_a_second_backward_through_the_summed_loss_is_refused():
    head, (hidden, labels) = _head(False), _inputs()
    loss = fused_loss_sum(head, hidden, labels, 8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


# ------------------------------------------------------------------ the memory estimate

def test_the_estimate_counts_one_chunk_of_logits_with_the_fused_loss():
    from lmforge.config import load_config
    from lmforge.models.presets import PRESETS
    from lmforge.perf.estimate import estimate_memory
    from lmforge.perf.estimate_setup import setup_from_config

    def phases(*overrides):
        cfg = load_config(None, ["data.seq_len=2048", "data.micro_batch_size=8",
                                 "train.dtype=bf16", *overrides])
        return estimate_memory(setup_from_config(cfg, device="cuda",
                                                 args=PRESETS["llama3.2-1b"])).phases

    plain, fused = phases(), phases("train.fused_loss=true")
    chunked = phases("train.loss_chunk_tokens=1024")
    # 16,384 tokens x 128,256 logits: the plain head's fp32 logits alone are 7.8 GiB
    assert plain["forward end"] - fused["forward end"] > 7.8 * 2**30
    # one 1,024-token chunk each; the fused summed loss also holds the head weight's fp32
    # gradient from forward to backward
    assert fused["forward end"] == chunked["forward end"] + 4 * 128256 * 2048
