"""lora.targets has one rule (peft/targets.py), and every user reads it: the trainer's
LoRA swap, QLoRA's quantization, the FLOPs count / memory estimate (lora_spec) and the
trainer's refusal of a bad config before any compute."""
import pytest

from lmforge.config import ConfigError, JobConfig, load_config
from lmforge.peft import apply_lora, lora_layers, quantize_base
from lmforge.models.registry import PRESETS, family_of
from lmforge.peft.targets import LoraSpec, lora_spec, resolve_targets, target_modules

LLAMA = family_of(PRESETS["debug"]).projections  # the tests' family: Llama's names
PROJECTIONS = LLAMA.all
from lmforge.train.loop import train


@pytest.mark.parametrize("targets, expected", [
    ("q_proj", ("q_proj",)),
    (["v_proj", "q_proj", "q_proj"], ("q_proj", "v_proj")),  # model order, each once
    (["wq", "wk", "wv", "wo", "w1", "w2", "w3"], PROJECTIONS),  # Meta's names
    (["q", "k", "v", "o", "gate", "up", "down"], PROJECTIONS),  # short names
    (["attention.q_proj", "self_attn.v_proj", "feed_forward.w2", "mlp.up_proj"],
     ("q_proj", "v_proj", "up_proj", "down_proj")),  # module paths: the leaf decides
    ([" Q_PROJ ", "All-Linear"], PROJECTIONS),  # case and spaces ignored
])
def test_aliases_and_paths_resolve_to_projection_names_in_model_order(targets, expected):
    assert resolve_targets(targets, LLAMA) == expected


@pytest.mark.parametrize("group, expected", [
    ("all-linear", PROJECTIONS), ("all_linear", PROJECTIONS),
    ("attention", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("mlp", ("gate_proj", "up_proj", "down_proj")),
    ("ffn", ("gate_proj", "up_proj", "down_proj")),
    ("feed_forward", ("gate_proj", "up_proj", "down_proj")),
])
def test_groups_resolve_to_their_projections(group, expected):
    assert resolve_targets(group, LLAMA) == expected
    assert resolve_targets([group, "q_proj"], LLAMA) == tuple(p for p in PROJECTIONS
                                                        if p in expected or p == "q_proj")


@pytest.mark.parametrize("targets, message", [
    (["lm_head"], "lora.targets: unknown module 'lm_head'"),
    (["q_proj", "embed_tokens"], "lora.targets: unknown module 'embed_tokens'"),
    ("all", "lora.targets: unknown module 'all'"),  # could be read to include the head
    (["layers.0.attention.q_proj"], "lora.targets: .* names one layer"),
    ([], "lora.targets: expected a list"),
    (5, "lora.targets: expected a list"),
])
def test_anything_else_is_refused_naming_lora_targets(targets, message):
    with pytest.raises(ConfigError, match=message):
        resolve_targets(targets, LLAMA)


def test_unset_targets_are_the_familys_default_as_peft_s():
    assert JobConfig().lora.targets is None
    assert resolve_targets(None, LLAMA) == ("q_proj", "v_proj")
    for preset, default in (("gptj-tiny", ("q_proj", "v_proj")), ("phi4-mini", ("qkv_proj",)),
                            ("gemma3-1b", ("q_proj", "v_proj"))):
        assert resolve_targets(None, family_of(PRESETS[preset]).projections) == default


def test_lora_spec_reads_the_config_section():
    cfg = JobConfig()
    assert lora_spec(cfg, LLAMA) is None  # present but disabled
    cfg.lora.enabled, cfg.lora.rank, cfg.lora.targets = True, 16, "all-linear"
    cfg.lora.quantize = "nf4"
    spec = lora_spec(cfg, LLAMA)
    assert spec.rank == 16 and spec.targets == PROJECTIONS and spec.quantize == "nf4"
    cfg.lora.targets = ["wq", "attention.v_proj"]
    assert lora_spec(cfg, LLAMA).targets == ("q_proj", "v_proj")
    cfg.lora.targets = ["lm_head"]
    with pytest.raises(ValueError, match="lora.targets"):
        lora_spec(cfg, LLAMA)
    cfg.lora.enabled = False  # refused even when LoRA is off, as config validation did
    with pytest.raises(ConfigError, match="lora.targets"):
        lora_spec(cfg, LLAMA)


def test_the_lora_swap_and_quantization_accept_the_same_aliases(lib):
    model = lib.tiny_model()
    swapped = apply_lora(model, lib.lora_cfg(targets=["wq", "mlp"]))
    leaves = {name.rsplit(".", 1)[-1] for name in swapped}
    assert leaves == {"q_proj", "gate_proj", "up_proj", "down_proj"}
    done = quantize_base(model, "int8", ["attention.v_proj"])
    assert done == ["layers.0.attention.v_proj", "layers.1.attention.v_proj"]
    with pytest.raises(ConfigError, match="lora.targets: unknown module 'lm_head'"):
        apply_lora(lib.tiny_model(), lib.lora_cfg(targets=["lm_head"]))
    with pytest.raises(ConfigError, match="lora.targets: unknown module 'lm_head'"):
        quantize_base(lib.tiny_model(), "int8", ["lm_head"])
    assert len(lora_layers(model)) == 8


def test_peft_target_modules_are_the_sorted_leaf_names():
    names = ["model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.v_proj",
             "model.layers.0.self_attn.q_proj"]
    assert target_modules(names) == ["q_proj", "v_proj"]


def test_the_trainer_refuses_a_bad_target_before_creating_the_run_directory(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, ["lora.enabled=true", "lora.targets=[q_proj,lm_head]",
                             f"train.output_dir={out}"])
    with pytest.raises(ConfigError, match="lora.targets: unknown module 'lm_head'"):
        train(cfg)
    assert not out.exists()
