"""LoRA in the trainer: only adapters train; under bf16 compute the frozen projections
are stored in bf16 (no autocast copies), adapters and norms stay fp32."""
import torch

from lmforge.config import load_config
from lmforge.models.presets import PRESETS
from lmforge.peft import lora_layers, save_adapter
from lmforge.job import resolve
from lmforge.train.model_setup import build_train_model
from lmforge.train.optim import Optimizers


def _model(*overrides):
    cfg = load_config(None, ["lora.enabled=true", "lora.targets=all-linear", *overrides])
    return cfg, build_train_model(resolve(cfg, args=PRESETS["debug"]), torch.device("cpu"))


def test_only_adapters_train_and_reach_the_optimizer():
    cfg, tm = _model()
    named = dict(tm.parts[0].named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    optimizers = Optimizers(tm.parts, cfg.optim, 10)
    in_optimizer = {id(p) for g in optimizers.optimizers[0].param_groups for p in g["params"]}
    assert in_optimizer == {id(named[n]) for n in trainable}


def test_bf16_compute_stores_frozen_projections_in_bf16():
    _, tm = _model("train.dtype=bf16")
    for name, p in tm.parts[0].named_parameters():
        if name.endswith(("lora_a", "lora_b")) or "norm" in name or "tok_embeddings" in name:
            assert p.dtype == torch.float32, name
        elif name.endswith("proj.weight"):
            assert p.dtype == torch.bfloat16, name
    _, fp32 = _model("train.dtype=fp32")
    assert all(p.dtype == torch.float32 for p in fp32.parts[0].parameters())


def test_lora_adapter_from_is_loaded_into_the_trainers_model(tmp_path):
    _, source = _model()
    torch.manual_seed(3)
    with torch.no_grad():
        for layer in lora_layers(source.parts[0]).values():
            layer.lora_b.normal_()  # a fresh adapter has B = 0: make it tell
    save_adapter(source.parts[0], tmp_path / "adapter")
    _, tm = _model(f"lora.adapter_from={tmp_path / 'adapter'}")
    loaded = lora_layers(tm.parts[0])
    for name, layer in lora_layers(source.parts[0]).items():
        assert torch.equal(loaded[name].lora_a, layer.lora_a), name
        assert torch.equal(loaded[name].lora_b, layer.lora_b), name
