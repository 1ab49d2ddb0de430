"""Save -> load gives back exactly the training state: the next steps' losses equal those
of the run that never stopped (model, AdamW moments, LR schedule, RNG all restored); and
a checkpoint's model read offline."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.tiny_models import tiny_llama_args
from lmforge.checkpoint import (CheckpointError, capture_rng, latest_checkpoint,
                                load_checkpoint, read_job_config, read_meta, read_model_state,
                                restore_rng, save_checkpoint)
from lmforge.config import OptimConfig
from lmforge.models.llama import LlamaArgs, build_llama, materialize
from lmforge.train.optim import build_optimizer, build_scheduler

ARGS = tiny_llama_args()
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.1)
MAX_STEPS = 10


def make_run(seed: int, args: LlamaArgs = ARGS):
    torch.manual_seed(seed)
    model = materialize(build_llama(args, "meta"), "cpu")
    optimizer = build_optimizer(model, OPTIM)
    return model, optimizer, build_scheduler(optimizer, OPTIM, MAX_STEPS)


def train_step(model, optimizer, scheduler) -> float:
    # Every generator feeds the step, so a missed RNG restore changes the loss.
    tokens = torch.randint(0, ARGS.vocab_size, (2, 17))
    scale = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    (loss * scale).backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def test_resumed_losses_equal_uninterrupted(tmp_path):
    model, optimizer, scheduler = make_run(seed=0)
    for _ in range(3):
        train_step(model, optimizer, scheduler)
    extra = {"step": 3, "scheduler": scheduler.state_dict(), "data": {"consumed": 48}}
    path = save_checkpoint(tmp_path, 3, model, optimizer, extra, capture_rng(),
                           {"train": {"seed": 0}})
    expected = [train_step(model, optimizer, scheduler) for _ in range(3)]

    model2, optimizer2, scheduler2 = make_run(seed=1)  # other weights, other RNG
    random.seed(99)
    np.random.seed(99)
    got_extra, rank_state = load_checkpoint(latest_checkpoint(tmp_path), model2, optimizer2)
    assert got_extra["step"] == 3 and got_extra["data"] == {"consumed": 48}
    scheduler2.load_state_dict(got_extra["scheduler"])
    restore_rng(rank_state)
    got = [train_step(model2, optimizer2, scheduler2) for _ in range(3)]
    assert got == expected
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    assert path.name == "step-0000003"
    assert (path / "config.yaml").read_text().startswith("train:")
    assert read_meta(path)["model_args"]["dim"] == ARGS.dim


def test_optimizer_state_and_lr_restored(tmp_path):
    model, optimizer, scheduler = make_run(seed=0)
    for _ in range(4):
        train_step(model, optimizer, scheduler)
    save_checkpoint(tmp_path, 4, model, optimizer, {"scheduler": scheduler.state_dict()},
                    None, None)
    model2, optimizer2, scheduler2 = make_run(seed=5)
    extra, rank_state = load_checkpoint(tmp_path / "step-0000004", model2, optimizer2)
    scheduler2.load_state_dict(extra["scheduler"])
    assert rank_state is None  # none was saved: the caller reseeds
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    for group, group2 in zip(optimizer.param_groups, optimizer2.param_groups):
        assert group["lr"] == group2["lr"] and group["weight_decay"] == group2["weight_decay"]
    sd, sd2 = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    assert sd.keys() == sd2.keys()
    for key in sd:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd[key][name], sd2[key][name])


def test_rng_capture_restore_round_trip(tmp_path):
    state = capture_rng()
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    # What save/load does to it: torch.save, then torch.load(weights_only=True).
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    restore_rng(torch.load(path, weights_only=True))
    second = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def test_names_do_not_depend_on_compile_or_activation_checkpointing(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper)

    model, optimizer, scheduler = make_run(seed=0)
    train_step(model, optimizer, scheduler)
    # Wrappers that add name prefixes (_orig_mod., _checkpoint_wrapped_module.) ...
    model.layers["0"] = checkpoint_wrapper(model.layers["0"])
    compiled = torch.compile(model, backend="eager")
    save_checkpoint(tmp_path, 1, compiled, optimizer, {}, None, None)
    # ... and in-place compile (module.compile()) load back into a plain model.
    plain, plain_opt, _ = make_run(seed=1)
    plain.layers["1"].compile(backend="eager")
    load_checkpoint(tmp_path / "step-0000001", plain, plain_opt)
    for (name, a), b in zip(compiled.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert plain_opt.state_dict()["state"][0]["exp_avg"].abs().sum() > 0


def test_tied_embeddings_stay_tied_after_a_load(tmp_path):
    import dataclasses

    args = dataclasses.replace(ARGS, tie_embeddings=True)
    model, optimizer, _ = make_run(seed=0, args=args)
    save_checkpoint(tmp_path, 1, model, optimizer, {}, None, None)
    model2, optimizer2, _ = make_run(seed=1, args=args)
    load_checkpoint(tmp_path / "step-0000001", model2, optimizer2)
    assert model2.output.weight is model2.tok_embeddings.weight
    assert torch.equal(model2.output.weight, model.output.weight)


def test_loading_into_a_different_model_is_one_line(tmp_path):
    import dataclasses

    model, optimizer, _ = make_run(seed=0)
    save_checkpoint(tmp_path, 1, model, optimizer, {}, None, None)
    other, other_opt, _ = make_run(seed=0, args=dataclasses.replace(ARGS, ffn_dim=96))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "step-0000001", other, other_opt)
    message = str(err.value)
    assert "\n" not in message and "step-0000001" in message


def test_non_json_extra_and_bad_rank_state_are_refused(tmp_path):
    model, optimizer, _ = make_run(seed=0)
    with pytest.raises(CheckpointError, match="extra: not JSON"):
        save_checkpoint(tmp_path, 1, model, optimizer, {"f": object()}, None, None)
    with pytest.raises(CheckpointError, match="rank_state"):
        save_checkpoint(tmp_path, 1, model, optimizer, {}, {"f": object()}, None)
    assert latest_checkpoint(tmp_path) is None
    assert not any(tmp_path.iterdir())  # the partial directory was removed


def test_read_model_state_gives_whole_tensors_without_a_process_group(tmp_path):
    model, optimizer, _ = make_run(seed=0)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {}, None, None)
    sd = read_model_state(path)
    assert sd.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(sd[name], value), name


def _stages(seed: int):
    """Two pipeline stages cut from one model: same parameter names as the whole model."""
    whole, _, _ = make_run(seed)
    first, _, _ = make_run(seed)
    second, _, _ = make_run(seed)
    del first.layers["1"]
    first.norm, first.output = None, None
    del second.layers["0"]
    second.tok_embeddings = None
    parts = [first, second]
    return whole, parts, [build_optimizer(p, OPTIM) for p in parts]


def _step_stages(parts, optimizers, tokens):
    hidden = parts[0](tokens[:, :-1])
    logits = parts[1](hidden)
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def test_pipeline_stages_and_whole_model_share_one_layout(tmp_path):
    tokens = torch.randint(0, ARGS.vocab_size, (2, 17))
    whole, parts, optimizers = _stages(seed=0)
    _step_stages(parts, optimizers, tokens)
    save_checkpoint(tmp_path / "pp", 1, parts, optimizers, {}, None, None)

    # Stages -> whole model (pp=2 -> pp=1), then whole -> stages again (pp=1 -> pp=2).
    whole2, optimizer2, _ = make_run(seed=9)
    load_checkpoint(tmp_path / "pp" / "step-0000001", whole2, optimizer2)
    merged = {**parts[0].state_dict(), **parts[1].state_dict()}
    assert merged.keys() == whole2.state_dict().keys()
    for name, value in whole2.state_dict().items():
        assert torch.equal(value, merged[name]), name
    save_checkpoint(tmp_path / "whole", 1, whole2, optimizer2, {}, None, None)
    _, parts3, optimizers3 = _stages(seed=5)
    load_checkpoint(tmp_path / "whole" / "step-0000001", parts3, optimizers3)
    # The next step from either layout gives the same weights.
    _step_stages(parts, optimizers, tokens)
    _step_stages(parts3, optimizers3, tokens)
    for p, p3 in zip(parts, parts3):
        for (name, a), b in zip(p.state_dict().items(), p3.state_dict().values()):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("text, message", [
    ('optim: !!python/object/apply:os.system ["touch F"]\n',
     r"config.yaml:1: the YAML tag !!python/object/apply:os.system is refused"),
    ("train: [1,\n", r"config.yaml:2: not valid YAML"),
    ("- train\n", r"config.yaml: top level must be a mapping of config sections"),
    ("nosection:\n  x: 1\n", r"config.yaml: nosection: unknown config section"),
])
def test_a_checkpoints_config_yaml_is_read_as_plain_data_or_refused_naming_it(
        tmp_path, text, message):
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/{message}"):
        read_job_config(tmp_path)
    assert not (tmp_path / "F").exists()
