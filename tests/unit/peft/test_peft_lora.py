"""LoRA layer, swap on meta and real models, freezing, merge/unmerge, counts, config."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lmforge.config import ConfigError, JobConfig, LoraConfig, OptimConfig, load_config
from lmforge.models.llama import build_llama, materialize
from lmforge.models.presets import PRESETS
from lmforge.peft import (LoraError, LoraLinear, after_materialize, apply_lora,
                          count_trainable, lora_layers, merge_lora, prepare_model_for_lora,
                          trainable_summary, unmerge_lora)
from lmforge.peft.targets import model_projections, resolve_targets
from lmforge.train.optim import build_optimizer


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_linear_is_base_plus_scaled_low_rank_update(rslora):
    torch.manual_seed(0)
    base = nn.Linear(12, 10, bias=True)
    layer = LoraLinear.from_linear(base, rank=3, alpha=6.0, rslora=rslora)
    assert layer.weight is base.weight and layer.bias is base.bias  # no copy
    x = torch.randn(5, 12)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)  # fresh: B = 0
    with torch.no_grad():
        layer.lora_b.normal_()
    scaling = 6.0 / (math.sqrt(3) if rslora else 3)
    assert layer.scaling == pytest.approx(scaling)
    expected = base(x) + scaling * (x @ layer.lora_a.T) @ layer.lora_b.T
    torch.testing.assert_close(layer(x), expected)


def test_init_is_kaiming_uniform_a_and_zero_b():
    layer = LoraLinear(256, 32, rank=8, alpha=16)
    assert torch.count_nonzero(layer.lora_b) == 0
    bound = 1 / math.sqrt(256)  # kaiming_uniform(a=sqrt(5)) on fan_in 256
    assert layer.lora_a.abs().max() <= bound and layer.lora_a.abs().max() > bound / 2


def test_dropout_applies_to_the_adapter_input_in_training_only():
    torch.manual_seed(0)
    layer = LoraLinear(16, 16, rank=4, alpha=4, dropout=0.5)
    with torch.no_grad():
        layer.lora_b.normal_()
    x = torch.randn(4, 16)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer(x))


def test_apply_on_meta_then_materialize_and_init(lib):
    model = build_llama(lib.TINY)  # meta
    swapped = prepare_model_for_lora(model, lib.lora_cfg(targets="all-linear"))
    assert len(swapped) == 7 * lib.TINY.n_layers
    assert all(p.is_meta for p in model.parameters())
    materialize(model, "cpu")
    after_materialize(model, lib.lora_cfg(targets="all-linear"))
    for layer in lora_layers(model).values():
        assert torch.count_nonzero(layer.lora_b) == 0
        assert torch.isfinite(layer.lora_a).all() and layer.lora_a.abs().sum() > 0


def test_base_checkpoint_loads_unchanged_into_a_lora_model(lib):
    base = lib.tiny_model()
    model = build_llama(lib.TINY)
    prepare_model_for_lora(model, lib.lora_cfg())
    materialize(model, "cpu", init=False)
    result = model.load_state_dict(base.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert sorted(result.missing_keys) == sorted(
        f"layers.{i}.attention.{m}.{ab}" for i in range(2) for m in ("q_proj", "v_proj")
        for ab in ("lora_a", "lora_b"))
    after_materialize(model, lib.lora_cfg())
    x = lib.tokens()
    torch.testing.assert_close(model.eval()(x), base(x), rtol=0, atol=0)


def test_only_adapter_parameters_get_gradients_and_optimizer_slots(lib):
    model = lib.tiny_model()
    prepare_model_for_lora(model, lib.lora_cfg(targets="all-linear"))
    lib.randomize_adapters(model)
    lora_ids = {id(p) for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b"))}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if id(p) not in lora_ids}
    optimizer = build_optimizer(model.train(), OptimConfig())
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == lora_ids
    model(lib.tokens()).float().logsumexp(-1).mean().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in model.named_parameters() if id(p) in lora_ids}
    optimizer.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_merge_and_unmerge_keep_the_logits(lib):
    model = lib.tiny_model()
    apply_lora(model, lib.lora_cfg(targets="all-linear", rslora=True))
    lib.randomize_adapters(model)
    x = lib.tokens()
    before = model(x)
    weights = {n: m.weight.clone() for n, m in lora_layers(model).items()}
    assert merge_lora(model) == 14
    assert all(m.merged for m in lora_layers(model).values())
    assert lib.max_rel_err(model(x), before) < 1e-5
    merge_lora(model)  # idempotent
    unmerge_lora(model)
    assert lib.max_rel_err(model(x), before) < 1e-5
    for n, m in lora_layers(model).items():
        torch.testing.assert_close(m.weight, weights[n], rtol=0, atol=1e-6)


def test_trainable_summary_of_llama2_7b_on_meta():
    model = build_llama(PRESETS["llama2-7b"])  # meta: costs nothing
    prepare_model_for_lora(model, LoraConfig(enabled=True, rank=8, targets=["q_proj", "v_proj"]))
    trainable, total = count_trainable(model)
    assert trainable == 32 * 2 * 8 * (4096 + 4096)
    assert total == 6_738_415_616 + trainable
    assert trainable_summary(model) == "4.19M trainable / 6.74B total (0.06%)"


def test_unknown_targets_and_non_linear_modules_are_refused_naming_lora_targets(lib):
    model = lib.tiny_model()
    with pytest.raises(ConfigError, match="lora.targets: unknown module 'q_projection'"):
        apply_lora(model, lib.lora_cfg(targets=["q_projection"]))
    with pytest.raises(LoraError, match="lora.targets: .* not a linear"):
        apply_lora(model, lib.lora_cfg(), module_names=["layers.0.attention"])


def test_config_section_and_validation_name_the_field(tmp_path):
    cfg = load_config(None, ["lora.enabled=true", "lora.targets=all-linear", "lora.rank=16",
                             "lora.quantize=nf4"])
    cfg.validate()
    assert cfg.lora.targets == "all-linear" and cfg.lora.rank == 16
    cfg = load_config(None, ["lora.enabled=true", "lora.targets=[q_proj,k_proj]"])
    assert cfg.lora.targets == ["q_proj", "k_proj"]
    for override, message in [
            ("lora.rank=0", "lora.rank: must be > 0"),
            ("lora.alpha=0", "lora.alpha: must be > 0"),
            ("lora.dropout=1.0", "lora.dropout: must be in"),
            ("lora.quantize=fp4", "lora.quantize: 'fp4' is not one of"),
            (f"lora.adapter_from={tmp_path}", "lora.adapter_from: .* no adapter_config")]:
        cfg = load_config(None, ["lora.enabled=true", override])
        with pytest.raises(ConfigError, match=message):
            cfg.validate()
    with pytest.raises(ConfigError, match="lora.quantize: .*lora.enabled"):
        load_config(None, ["lora.quantize=nf4"]).validate()
    # lora.targets: peft.targets' rule, which the trainer applies right after validate()
    # (tests/unit/peft/test_targets.py)
    cfg = load_config(None, ["lora.enabled=true", "lora.targets=[q_proj,lm_head]"])
    with pytest.raises(ConfigError, match="lora.targets: unknown module 'lm_head'"):
        resolve_targets(cfg.validate().lora.targets, model_projections(build_llama(PRESETS["debug"])))
    assert JobConfig().lora.enabled is False
