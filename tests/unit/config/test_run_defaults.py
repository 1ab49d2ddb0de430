"""Fine-tuning defaults: a run with model.init_from does not inherit the CPU demo's peak LR,
fixed warmup, code prompt or preset; a value its config gives always wins."""
import pytest
import yaml

from lmforge.config import load_config, save_config, warmup_warning
from lmforge.config.defaults import FULL_FINE_TUNING_LR, LORA_LR
from lmforge.perf.report import Run, summarize


@pytest.mark.parametrize("lora, lr", [("false", FULL_FINE_TUNING_LR), ("true", LORA_LR)])
def test_init_from_takes_fine_tuning_defaults_on_unset_keys(lora, lr):
    cfg = load_config(None, ["model.init_from=/models/base", f"lora.enabled={lora}",
                             "train.max_steps=1000"])
    assert cfg.optim.lr == lr and 1e-5 <= lr <= 3e-4
    assert cfg.optim.warmup_steps == 30  # 3% of max_steps
    assert cfg.model.preset is None and cfg.train.sample_prompt is None
    demo = load_config(None)  # no init_from: the demo's own
    assert (demo.optim.lr, demo.optim.warmup_steps) == (2e-3, 20)
    assert demo.train.sample_prompt == "def " and demo.model.preset == "tiny"


def test_explicit_values_win_even_when_they_equal_the_demo_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  init_from: /models/base\n  preset: tiny\n"
                    "optim:\n  lr: 2.0e-3\n")
    cfg = load_config(path, ["train.sample_prompt=Question"])
    assert cfg.optim.lr == 2e-3 and cfg.model.preset == "tiny"
    assert cfg.train.sample_prompt == "Question"
    assert cfg.optim.warmup_steps == 9  # not given: 3% of the 300 steps, rounded up
    given = load_config(path, ["optim.warmup_steps=20"])
    assert given.optim.warmup_steps == 20 and given.train.sample_prompt is None


def test_saved_config_names_the_run_by_its_init_from(tmp_path):
    cfg = load_config(None, ["model.init_from=/models/base"])
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["preset"] is None and saved["optim"]["lr"] == FULL_FINE_TUNING_LR
    run = Run("r", tmp_path, [{"step": 1, "loss": 1.0}], saved)
    assert summarize(run)["setup"].startswith("/models/base,")
    # a saved config read back (a resume) is complete: it keeps its values
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_warmup_at_least_the_run_is_warned_in_one_line():
    cfg = load_config(None, ["train.max_steps=10"])
    warning = warmup_warning(cfg)
    assert "optim.warmup_steps (20) >= train.max_steps (10)" in warning
    assert "\n" not in warning
    assert warmup_warning(load_config(None, ["train.max_steps=21"])) is None


def test_a_run_is_named_for_its_config_file_or_init_from_and_only_the_demo_uses_runs_demo(
        tmp_path):
    assert load_config(None).train.output_dir == "runs/demo"
    fine_tune = load_config(None, ["model.init_from=/models/Llama-3.2-1B/"])
    assert fine_tune.train.output_dir == "runs/Llama-3.2-1B"
    snapshot = "/hf/hub/models--meta-llama--Llama-3.2-1B/snapshots/4e20de3"
    assert load_config(None, [f"model.init_from={snapshot}"]).train.output_dir == \
        "runs/Llama-3.2-1B"
    recipe = tmp_path / "chat-sft.yaml"
    recipe.write_text("model:\n  init_from: /models/base\n")
    assert load_config(recipe).train.output_dir == "runs/chat-sft"
    given = load_config(recipe, ["train.output_dir=runs/demo"])  # given: always wins
    assert given.train.output_dir == "runs/demo"
