"""``lmforge train --print-config`` and ``--dry-run``: the run's config and shape, printed
without a run (nothing computed, nothing written)."""
import torch
import yaml

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.perf.estimate import estimate_memory, format_table
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.train.loop import Runtime, prepare_output_dir


def test_print_config_prints_what_the_run_saves_and_exits(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("optim:\n  lr: 3.0e-4\ntrain:\n  max_steps: 7\n")
    overrides = ["optim.lr=1e-3", "lora.enabled=true", f"train.output_dir={tmp_path}/run"]
    assert main(["train", str(recipe), *overrides, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [recipe], "no run directory, no files"
    resolved = yaml.safe_load(printed)
    assert resolved["optim"]["lr"] == 1e-3 and resolved["train"]["max_steps"] == 7
    assert resolved["lora"]["enabled"] is True and resolved["model"]["preset"] == "tiny"
    # byte for byte what a run writes as config.yaml
    cfg = load_config(recipe, overrides)
    _, claim = prepare_output_dir(cfg, Runtime(device=torch.device("cpu"), autocast=None))
    claim.start(cfg)  # (config.yaml is written once the run is past its checks)
    claim.release()
    assert (tmp_path / "run" / "config.yaml").read_text() == printed


def test_dry_run_prints_parameter_counts_and_the_estimate_and_writes_nothing(
        capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = ["lora.enabled=true", "lora.targets=all-linear", "model.vocab_size=512",
                 "train.device=cpu", f"train.output_dir={tmp_path}/run"]
    assert main(["train", *overrides, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [], "nothing written (no run dir, no tokenizer)"
    counts = next(line for line in out.splitlines() if line.startswith("parameters: "))
    trainable, total = counts.removeprefix("parameters: ").split(" / ")
    assert trainable.endswith(" trainable") and total.startswith("3.")  # tiny: 3.x M
    assert "(100.00%)" not in counts  # LoRA trains its adapters only
    # the estimate exactly as `lmforge estimate` prints it (the same function)
    assert format_table(estimate_memory(setup_from_config(load_config(None, overrides)))) in out


def test_dry_run_checks_the_layout_for_the_world_size_it_is_given(capsys, tmp_path):
    base = ["train", "parallel.tp=2", f"train.output_dir={tmp_path}/run", "--dry-run"]
    assert main([*base, "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "4 device(s)" in out and "dp_shard 2 x cp 1 x tp 2" in out
    assert main(base) == 2  # one process cannot hold tp=2, as train says
    assert "parallel" in capsys.readouterr().err
    assert main(["train", "--world-size", "4"]) == 2  # only with --dry-run
    assert "--world-size" in capsys.readouterr().err


def test_print_config_refuses_what_the_run_would_and_takes_the_world_size(capsys, tmp_path):
    """--print-config resolves the job as the run would: a layout for 8 processes is
    refused on one (naming the field) and printed for the 8 --world-size gives it."""
    base = ["train", "parallel.dp_shard=8", f"train.output_dir={tmp_path}/run",
            "--print-config"]
    assert main(base) == 2
    assert "parallel.dp_shard" in capsys.readouterr().err
    assert main([*base, "--world-size", "8"]) == 0
    assert "dp_shard: 8" in capsys.readouterr().out
