"""Bad input exits non-zero with one line naming the field or file, before any compute."""
import json
import os
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.data.tokenizer import train_bpe
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
@pytest.mark.parametrize("flags", [[], ["--dry-run"]])  # a dry run refuses the same
def test_bad_config_values_exit_with_one_line(capsys, tmp_path, override, field, flags):
    code, err = _run(capsys, ["train", override, f"train.output_dir={tmp_path}/run", *flags])
    assert code == 2
    assert err.count("\n") == 0 and err.startswith(f"lmforge: error: {field}")
    assert not (tmp_path / "run").exists(), "refused before anything was written"


@pytest.mark.parametrize("overrides, field", [
    (["data.micro_batch_size=1"], "data.micro_batch_size"),  # 1 sequence, 2 stages
    (["parallel.microbatches=3"], "parallel.microbatches"),  # does not divide 8
])
def test_a_batch_the_pipeline_cannot_split_is_refused_before_any_process_group(
        capsys, monkeypatch, tmp_path, overrides, field):
    # Rank 0 of 2 under torchrun, with no rendezvous to reach: refused by validation.
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    code, err = _run(capsys, ["train", "parallel.pp=2", "parallel.dp_shard=1", *overrides,
                              f"train.output_dir={tmp_path}/run"])
    assert code == 2 and err.startswith(f"lmforge: error: {field}: ") and "\n" not in err
    assert not (tmp_path / "run").exists()


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
    model = tmp_path / "model"
    lines = [f"line {i} about tensors" for i in range(50)]
    train_bpe(lines, 300).save(model)  # config and tokenizer, but no weights
    (model / "config.json").write_text(json.dumps(hf_config_from_args(tiny_llama_args())))
    (tmp_path / "text.txt").write_text("\n".join(lines))
    code, err = _run(capsys, ["eval", "--model", str(model), "--data",
                              str(tmp_path / "text.txt")])
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


# An output that cannot be written is refused first, in one line naming it: the inputs
# named here do not exist, so any work done before the check would fail differently.

def _unwritable_outputs(tmp_path, how):
    """(a file output, a directory output) that cannot be written, ``how``: read-only
    (a directory without write permission), in-the-way (a file or directory is where
    the other kind is needed) or no-new-files (/proc: its permission bits let root
    write, the file system refuses new files)."""
    if how == "no-new-files":
        return Path("/proc/lmforge-out"), Path("/proc/lmforge-out-dir")
    if how == "read-only":
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return locked / "out", locked / "out-dir"
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    return tmp_path / "a-dir", tmp_path / "a-file"


CASES = [pytest.param("read-only", marks=pytest.mark.skipif(
    os.geteuid() == 0, reason="root ignores file permissions")), "in-the-way",
    pytest.param("no-new-files", marks=pytest.mark.skipif(
        not Path("/proc/self").is_dir(), reason="no /proc on this system"))]


def _refused_in_one_line(capsys, argv, output):
    code, err = _run(capsys, argv)
    assert code == 2 and "\n" not in err and err.startswith(f"lmforge: error: {output}")
    return err


@pytest.mark.parametrize("how", CASES)
def test_preprocess_refuses_an_unwritable_output_prefix_before_reading_anything(
        capsys, tmp_path, how):
    prefix, _ = _unwritable_outputs(tmp_path, how)
    if how == "in-the-way":  # PREFIX.bin is a directory
        (tmp_path / "corpus.bin").mkdir()
        prefix = tmp_path / "corpus"
    err = _refused_in_one_line(capsys, ["preprocess", "--input", str(tmp_path / "absent"),
                                        "--output-prefix", str(prefix), "--tokenizer",
                                        str(tmp_path / "no-tokenizer")], prefix)
    assert "--output-prefix" in err


@pytest.mark.parametrize("how", CASES)
def test_tokenizer_train_refuses_an_unwritable_output_before_training(capsys, tmp_path, how):
    _, out_dir = _unwritable_outputs(tmp_path, how)
    err = _refused_in_one_line(capsys, ["tokenizer", "train", "--input",
                                        str(tmp_path / "absent"), "--vocab-size", "300",
                                        "--output", str(out_dir)], out_dir)
    assert "--output" in err


@pytest.mark.parametrize("how", CASES)
def test_export_refuses_an_unwritable_out_dir_before_reading_the_checkpoint(
        capsys, tmp_path, how):
    _, out_dir = _unwritable_outputs(tmp_path, how)
    err = _refused_in_one_line(capsys, ["export", str(tmp_path / "no-checkpoint"),
                                        str(out_dir)], out_dir)
    assert "OUT_DIR" in err


@pytest.mark.parametrize("how", CASES)
def test_eval_refuses_an_unwritable_output_before_evaluating(capsys, tmp_path, monkeypatch,
                                                             how):
    import lmforge.cli.evaluate as cli_eval

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded or evaluated before the output check")

    for name in ("load_hf_model", "load_tokenizer", "eval_batches_for", "evaluate"):
        monkeypatch.setattr(cli_eval, name, no_work)
    out_file, _ = _unwritable_outputs(tmp_path, how)
    err = _refused_in_one_line(capsys, ["eval", "--model", str(tmp_path / "m"), "--data", "x",
                                        "--output", str(out_file)], out_file)
    assert "--output" in err


def test_eval_refuses_a_seq_len_above_the_models_maximum_naming_both(capsys, tmp_path):
    args = tiny_llama_args()
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_args(args)))
    too_long = args.max_seq_len + 1
    code, err = _run(capsys, ["eval", "--model", str(tmp_path), "--data", str(tmp_path),
                              "--seq-len", str(too_long),  # --output beside the model
                              "--output", str(tmp_path.with_name(f"{tmp_path.name}.json"))])
    assert code == 2 and "\n" not in err
    assert err.startswith(f"lmforge: error: --seq-len: {too_long} is above the model's "
                          f"maximum sequence length {args.max_seq_len}")
