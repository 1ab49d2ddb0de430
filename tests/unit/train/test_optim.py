"""The optimizer's parameter groups: never an empty one (a LoRA run trains matrices only,
and torch's distributed optimizer state cannot load an empty group back, so such a run
could not resume), and a LoRA checkpoint saved while its no-decay group was still built
empty resumes (its schedule lists one value per group, the empty one's too)."""
import torch

from lmforge.checkpoint import load_checkpoint, save_checkpoint
from lmforge.config import load_config
from lmforge.models.presets import PRESETS
from lmforge.job import resolve
from lmforge.train.model_setup import build_train_model
from lmforge.train.optim import Optimizers, build_optimizer, build_scheduler


def _lora_model(*overrides):
    cfg = load_config(None, ["lora.enabled=true", "lora.targets=all-linear",
                             "optim.weight_decay=0.1", "optim.warmup_steps=0", *overrides])
    return cfg, build_train_model(resolve(cfg, args=PRESETS["debug"]), torch.device("cpu")).parts[0]


def test_lora_adapters_make_one_group_norms_training_beside_them_a_second():
    cfg, model = _lora_model()
    groups = build_optimizer(model, cfg.optim).param_groups
    assert [g["weight_decay"] for g in groups] == [0.1]
    adapters = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in groups[0]["params"]} == adapters

    norms = [p for name, p in model.named_parameters() if "norm" in name]
    for p in norms:
        p.requires_grad_(True)
    groups = build_optimizer(model, cfg.optim).param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert {id(p) for p in groups[0]["params"]} == adapters
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in norms}


def _step(optimizer, schedule, params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()
    schedule.step()


def test_a_checkpoint_saved_with_an_empty_no_decay_group_resumes(tmp_path):
    cfg, model = _lora_model()
    trained = [p for p in model.parameters() if p.requires_grad]
    # What build_optimizer built before empty groups were dropped.
    old = torch.optim.AdamW([{"params": trained, "weight_decay": 0.1},
                             {"params": [], "weight_decay": 0.0}], lr=cfg.optim.lr)
    old_schedule = build_scheduler(old, cfg.optim, 10)
    for seed in (1, 2):
        _step(old, old_schedule, trained, seed)
    path = save_checkpoint(tmp_path, 2, model, old, {"scheduler": old_schedule.state_dict()},
                           None, None)

    _, fresh = _lora_model()
    optimizers = Optimizers([fresh], cfg.optim, 10)
    extra, _ = load_checkpoint(path, [fresh], optimizers.optimizers)
    optimizers.load_scheduler_state(extra["scheduler"])
    assert optimizers.lr == old.param_groups[0]["lr"]
    resumed = [p for p in fresh.parameters() if p.requires_grad]
    _step(old, old_schedule, trained, 3)
    _step(optimizers.optimizers[0], optimizers.schedulers[0], resumed, 3)
    assert optimizers.lr == old.param_groups[0]["lr"]
    for before, after in zip(trained, resumed, strict=True):
        assert torch.equal(before, after)
