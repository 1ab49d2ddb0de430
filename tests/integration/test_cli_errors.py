"""Bad input exits non-zero with one line naming the field or file, before any compute."""
import json
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.models.hf import hf_config_from_args

from helpers.tiny_models import tiny_llama_args


def _run(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("override, field", [
    ("optim.lr=-1", "optim.lr"),
    ("optim.lr=inf", "optim.lr"),
    ("model.n_kv_heads=3", "model.n_kv_heads"),
    ("data.seq_len=100000", "data.seq_len"),
    ("optim.nope=1", "optim.nope"),
    ("model.preset=gpt5", "model.preset"),
])
def test_bad_config_values_exit_with_one_line(capsys, tmp_path, override, field):
    code, err = _run(capsys, ["train", override, f"train.output_dir={tmp_path}/run"])
    assert code == 2
    assert err.count("\n") == 0 and err.startswith(f"lmforge: error: {field}")
    assert not (tmp_path / "run").exists(), "refused before anything was written"


def test_missing_config_file_exits_with_one_line_naming_it(capsys, tmp_path):
    code, err = _run(capsys, ["train", str(tmp_path / "nope.yaml")])
    assert code == 2 and "nope.yaml: not found" in err and "\n" not in err


def test_missing_model_dir_exits_with_one_line_naming_it_or_its_field(capsys, tmp_path):
    code, err = _run(capsys, ["eval", "--model", str(tmp_path / "absent"), "--data", "x"])
    assert code == 2 and "absent" in err and "\n" not in err
    code, err = _run(capsys, ["train", f"model.init_from={tmp_path / 'absent'}"])
    assert code == 2 and err.startswith("lmforge: error: model.init_from")


def test_malformed_or_incomplete_config_json_exits_naming_it(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{broken")
    code, err = _run(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert code == 2 and "config.json" in err and "\n" not in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, err = _run(capsys, ["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert code == 2 and "config.json" in err


def test_model_dir_without_weights_exits_naming_the_weights_file(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_args(tiny_llama_args())))
    code, err = _run(capsys, ["eval", "--model", str(tmp_path), "--data", str(tmp_path)])
    assert code == 2 and "model.safetensors" in err


def test_every_command_has_help(capsys):
    commands = [["train"], ["eval"], ["generate"], ["preprocess"], ["tokenizer", "train"],
                ["export"], ["estimate"], ["report"], ["launch", "slurm"], ["lora", "merge"],
                ["lora", "eval"]]
    for argv in [[]] + commands:
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
        assert "usage: lmforge" in capsys.readouterr().out


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"lmforge {version('lmforge')}"


def test_only_the_cli_package_knows_argparse():
    src = Path(__file__).parents[2] / "src" / "lmforge"
    users = sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                   if "argparse" in p.read_text() and p.parts[-2] != "cli")
    assert users == []
