"""Writing never destroys (issue 37, point 1): every writer refuses, before it writes
anything, an output that is not a regular file or a directory (a device, a FIFO, a
socket, itself or inside an existing output directory: a writer would replace it, write
into it or block on it), and an output that is, lies inside or holds one of the
command's own inputs. A killed export's temporaries are removed by the next write of
the same target, when their process is gone, never while it lives."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from helpers.bad_inputs import (Bad, check_refused, copy_asset, fake_checkpoint, fifo,
                                model_with, params, steps, write)
from lmforge import fsio
from lmforge.cli import main

# ---------------------------------------------------------------- odd write targets


def device(path: str):
    """A setup: a character device node at ``path`` under the row's directory (the null
    device's numbers, so a writer that wrote into it would lose nothing of the system's)."""
    def setup(tmp: Path, assets: dict) -> None:
        node = tmp / path
        node.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return setup


def unix_socket(path: str):
    """A setup: a bound (then closed) Unix socket's file at ``path``; bound by a relative
    name, as the row's directory may be longer than a socket address allows."""
    def setup(tmp: Path, assets: dict) -> None:
        node = tmp / path
        node.parent.mkdir(parents=True, exist_ok=True)
        here = os.getcwd()
        os.chdir(node.parent)
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(node.name)
        finally:
            os.chdir(here)
    return setup


def link(path: str, target: str):
    """A setup: ``path`` a symbolic link to ``target`` (``{name}`` of an asset, else a
    path under the row's directory)."""
    def setup(tmp: Path, assets: dict) -> None:
        name = target.strip("{}")
        (tmp / path).symlink_to(assets[name] if target.startswith("{") else tmp / target)
    return setup


def hard_link(path: str, target: str):
    def setup(tmp: Path, assets: dict) -> None:
        os.link(tmp / target, tmp / path)
    return setup


def special_in(directory: str, name: str, make=fifo):
    """A setup: ``directory`` (an asset's copy, or a new one) with ``name`` in it made a
    FIFO (or ``make``'s kind), as an output directory filled in place would meet it."""
    def setup(tmp: Path, assets: dict) -> None:
        if not (tmp / directory).exists():
            (tmp / directory).mkdir(parents=True)
        (tmp / directory / name).unlink(missing_ok=True)
        make(f"{directory}/{name}")(tmp, assets)
    return setup


RUN = fake_checkpoint("model:\n  preset: tiny\n")  # {tmp}/run/checkpoints/step-0000001
GGUF = ["--format", "gguf"]
GGUF_LORA = ["--format", "gguf-lora", "--base", "{model}"]
MERGE_TO = ["lora", "merge", "--model", "{model}", "--adapter", "{adapter}", "--output"]
EVAL = ["eval", "--model", "{model}", "--data", "{text}", "--output"]
EVAL_SFT = ["eval-sft", "--model", "{model}", "--data", "{chat}", "--output"]
LORA_EVAL = ["lora", "eval", "--model", "{model}", "--adapter", "{adapter}", "--data",
             "{chat}", "--output"]
BENCH = ["bench-eval", "--model", "{model}", "--tasks", "t", "--output"]
SLURM = ["launch", "slurm", "--nodes", "1", "--gpus-per-node", "1", "--output"]
PLAN = ["plan", "--gpus", "8", "--output"]
PREPROCESS = ["preprocess", "--input", "{text}", "--tokenizer", "{tokenizer}",
              "--output-prefix", "{tmp}/p"]
TOKENIZER = ["tokenizer", "train", "--input", "{text}", "--vocab-size", "300", "--output"]
REPORT = ["report", "{tmp}/run", "--output"]
GENERATE = ["generate", "--model", "{model}", "--prompts", "{tmp}/p.jsonl", "--output"]
PROMPTS = write("p.jsonl", '{"prompt": "hi"}\n')
TRAIN = ["train", "train.max_steps=1", "optim.warmup_steps=0"]
FILE_IN_WAY = r"is a file to write, but {what} is in the way"
DIR_IN_WAY = r"is a directory to write, but {what} is in the way"


def in_way(option: str, path: str, what: str, kind: str = "file") -> str:
    pattern = FILE_IN_WAY if kind == "file" else DIR_IN_WAY
    return rf"^{{tmp}}/{path}: {option} " + pattern.format(what=what)


def inside(option: str, directory: str, entry: str, what: str = "a FIFO") -> str:
    return rf"^{{tmp}}/{directory}: cannot write {option}: {{tmp}}/{directory}/{entry} in " \
           rf"it is {what}"


def apart(option: str, out: str, how: str, source_option: str, source: str) -> str:
    return rf"^{out}: {option} {how} the input {source_option} {source}; write it elsewhere"


SPECIAL_TARGETS = [
    # export, every format
    Bad("export gguf onto a fifo", ["export", "{model}", "{tmp}/m.gguf", *GGUF],
        in_way("OUT", r"m\.gguf", "a FIFO"), setup=fifo("m.gguf")),
    Bad("export gguf onto a device", ["export", "{model}", "{tmp}/m.gguf", *GGUF],
        in_way("OUT", r"m\.gguf", "a character device"), setup=device("m.gguf")),
    Bad("export gguf onto a socket", ["export", "{model}", "{tmp}/m.gguf", *GGUF],
        in_way("OUT", r"m\.gguf", "a socket"), setup=unix_socket("m.gguf")),
    Bad("export gguf onto a link to a fifo", ["export", "{model}", "{tmp}/m.gguf", *GGUF],
        in_way("OUT", r"m\.gguf", "a FIFO"), setup=steps(fifo("f"), link("m.gguf", "f"))),
    Bad("export gguf-lora onto a fifo", ["export", "{adapter}", "{tmp}/a.gguf", *GGUF_LORA],
        in_way("OUT", r"a\.gguf", "a FIFO"), setup=fifo("a.gguf")),
    Bad("export gguf-lora onto a device", ["export", "{adapter}", "{tmp}/a.gguf",
                                           *GGUF_LORA],
        in_way("OUT", r"a\.gguf", "a character device"), setup=device("a.gguf")),
    Bad("export hf onto a fifo", ["export", "{tmp}/run", "{tmp}/out"],
        in_way("OUT_DIR", "out", "a FIFO", "dir"), setup=steps(RUN, fifo("out"))),
    Bad("export peft onto a device", ["export", "{tmp}/run", "{tmp}/out", "--format", "peft"],
        in_way("OUT_DIR", "out", "a character device", "dir"),
        setup=steps(RUN, device("out"))),
    Bad("export merged onto a socket", ["export", "{tmp}/run", "{tmp}/out", "--format",
                                        "merged"],
        in_way("OUT_DIR", "out", "a socket", "dir"), setup=steps(RUN, unix_socket("out"))),
    Bad("export hf into a model directory holding a fifo", ["export", "{tmp}/run", "{tmp}/out"],
        inside("OUT_DIR", "out", r"model\.safetensors"),
        setup=steps(RUN, copy_asset("model", "out"), special_in("out", "model.safetensors"))),
    Bad("export peft into a directory holding a device deeper down",
        ["export", "{tmp}/run", "{tmp}/out", "--format", "peft"],
        inside("OUT_DIR", "out", "sub/dev", "a character device"),
        setup=steps(RUN, special_in("out/sub", "dev", device))),
    # lora merge
    Bad("lora merge onto a fifo", [*MERGE_TO, "{tmp}/out"],
        in_way("--output", "out", "a FIFO", "dir"), setup=fifo("out")),
    Bad("lora merge into a model directory holding a device", [*MERGE_TO, "{tmp}/out"],
        inside("--output", "out", r"config\.json", "a character device"),
        setup=steps(copy_asset("model", "out"), special_in("out", "config.json", device))),
    Bad("lora merge to gguf onto a fifo", [*MERGE_TO, "{tmp}/m.gguf", *GGUF],
        in_way("--output", r"m\.gguf", "a FIFO"), setup=fifo("m.gguf")),
    Bad("lora merge to gguf onto a device", [*MERGE_TO, "{tmp}/m.gguf", *GGUF],
        in_way("--output", r"m\.gguf", "a character device"), setup=device("m.gguf")),
    # the evaluations' results
    Bad("eval output onto a fifo", [*EVAL, "{tmp}/r.json"],
        in_way("--output", r"r\.json", "a FIFO"), setup=fifo("r.json")),
    Bad("eval output onto a device", [*EVAL, "{tmp}/r.json"],
        in_way("--output", r"r\.json", "a character device"), setup=device("r.json")),
    Bad("eval output onto a link to a device", [*EVAL, "{tmp}/r.json"],
        in_way("--output", r"r\.json", "a character device"),
        setup=steps(device("d"), link("r.json", "d"))),
    Bad("eval-sft output onto a fifo", [*EVAL_SFT, "{tmp}/r.json"],
        in_way("--output", r"r\.json", "a FIFO"), setup=fifo("r.json")),
    Bad("lora eval output onto a socket", [*LORA_EVAL, "{tmp}/r.json"],
        in_way("--output", r"r\.json", "a socket"), setup=unix_socket("r.json")),
    Bad("bench-eval output onto a fifo", [*BENCH, "{tmp}/r.json"],
        in_way("--output", r"r\.json", "a FIFO"), setup=fifo("r.json")),
    # scripts, plans, reports
    Bad("launch script onto a fifo", [*SLURM, "{tmp}/job.sbatch"],
        in_way("--output", r"job\.sbatch", "a FIFO"), setup=fifo("job.sbatch")),
    Bad("launch script onto a device", [*SLURM, "{tmp}/job.sbatch"],
        in_way("--output", r"job\.sbatch", "a character device"), setup=device("job.sbatch")),
    Bad("plan output onto a fifo", [*PLAN, "{tmp}/plan.yaml"],
        in_way("--output", r"plan\.yaml", "a FIFO"), setup=fifo("plan.yaml")),
    Bad("plan calibration onto a device",
        ["plan", "--gpus", "1", "--device", "cpu", "--calibrate", "--calibrate-dir",
         "{tmp}/cal", "--calibration", "{tmp}/cal.json"],
        in_way("--calibration", r"cal\.json", "a character device"), setup=device("cal.json")),
    Bad("plan calibrate-dir holding a fifo",
        ["plan", "--gpus", "1", "--device", "cpu", "--calibrate", "--calibrate-dir",
         "{tmp}/cal"],
        inside("--calibrate-dir", "cal", r"calibration\.json"),
        setup=special_in("cal", "calibration.json")),
    Bad("report onto a fifo", [*REPORT, "{tmp}/rep"],
        in_way("--output", "rep", "a FIFO", "dir"), setup=fifo("rep")),
    Bad("report into a directory whose summary is a fifo", [*REPORT, "{tmp}/rep"],
        inside("--output", "rep", r"summary\.md"), setup=special_in("rep", "summary.md")),
    # tokens and tokenizers
    Bad("preprocess bin onto a fifo", PREPROCESS,
        in_way("--output-prefix", r"p\.bin", "a FIFO"), setup=fifo("p.bin")),
    Bad("preprocess idx onto a device", PREPROCESS,
        in_way("--output-prefix", r"p\.idx", "a character device"), setup=device("p.idx")),
    Bad("preprocess pair record onto a fifo", PREPROCESS,
        in_way("--output-prefix", r"p\.pair", "a FIFO"), setup=fifo("p.pair")),
    Bad("preprocess lock file onto a fifo", PREPROCESS,
        in_way("--output-prefix", r"p\.lock", "a FIFO"), setup=fifo("p.lock")),
    Bad("preprocess bin of a second json key onto a socket",
        [*PREPROCESS, "--json-key", "text", "body"],
        in_way("--output-prefix", r"p_body_document\.bin", "a socket"),
        setup=unix_socket("p_body_document.bin")),
    # generated text, the run directory
    Bad("generate output onto a fifo", [*GENERATE, "{tmp}/out.jsonl"],
        in_way("--output", r"out\.jsonl", "a FIFO"), setup=steps(PROMPTS, fifo("out.jsonl"))),
    Bad("generate output onto a device", [*GENERATE, "{tmp}/out.jsonl"],
        in_way("--output", r"out\.jsonl", "a character device"),
        setup=steps(PROMPTS, device("out.jsonl"))),
    Bad("train output_dir a fifo", [*TRAIN, "train.output_dir={tmp}/run"],
        in_way("train.output_dir", "run", "a FIFO", "dir"), setup=fifo("run")),
    Bad("train output_dir whose config.yaml is a fifo", [*TRAIN, "train.output_dir={tmp}/run"],
        inside("train.output_dir", "run", r"config\.yaml"), setup=fifo("run/config.yaml")),
    Bad("train output_dir whose metrics are a device", [*TRAIN, "train.output_dir={tmp}/run"],
        inside("train.output_dir", "run", r"metrics\.jsonl", "a character device"),
        setup=special_in("run", "metrics.jsonl", device)),
    # tokens and tokenizers
    Bad("tokenizer output onto a fifo", [*TOKENIZER, "{tmp}/tok"],
        in_way("--output", "tok", "a FIFO", "dir"), setup=fifo("tok")),
    Bad("tokenizer output directory whose tokenizer.json is a fifo", [*TOKENIZER, "{tmp}/tok"],
        inside("--output", "tok", r"tokenizer\.json"),
        setup=special_in("tok", "tokenizer.json")),
    Bad("tokenizer output directory whose config is a device", [*TOKENIZER, "{tmp}/tok"],
        inside("--output", "tok", r"tokenizer_config\.json", "a character device"),
        setup=special_in("tok", "tokenizer_config.json", device)),
]

OWN_INPUTS = [
    # export: the model, the checkpoints, the tokenizer, the base
    Bad("export gguf onto the model's weights",
        ["export", "{tmp}/model", "{tmp}/model/model.safetensors", *GGUF],
        apart("OUT", r"{tmp}/model/model\.safetensors", "lies inside", "CHECKPOINT_DIR",
              "{tmp}/model"), setup=copy_asset("model")),
    Bad("export gguf into the run's checkpoints",
        ["export", "{tmp}/run", "{tmp}/run/checkpoints/m.gguf", *GGUF],
        apart("OUT", r"{tmp}/run/checkpoints/m\.gguf", "lies inside", "CHECKPOINT_DIR",
              "{tmp}/run/checkpoints"), setup=RUN),
    Bad("export hf into the checkpoint itself",
        ["export", "{tmp}/run/checkpoints/step-0000001",
         "{tmp}/run/checkpoints/step-0000001/hf"],
        apart("OUT", "{tmp}/run/checkpoints/step-0000001/hf", "lies inside",
              "CHECKPOINT_DIR", "{tmp}/run/checkpoints"), setup=RUN),
    Bad("export hf over the run's tokenizer", ["export", "{tmp}/run", "{tmp}/run/tokenizer"],
        apart("OUT", "{tmp}/run/tokenizer", "is", "CHECKPOINT_DIR", "{tmp}/run/tokenizer"),
        setup=steps(RUN, copy_asset("tokenizer", "run/tokenizer"))),
    Bad("export hf over the run itself", ["export", "{tmp}/run", "{tmp}/run"],
        apart("OUT", "{tmp}/run", "holds", "CHECKPOINT_DIR", "{tmp}/run/checkpoints"),
        setup=RUN),
    Bad("export hf over its --tokenizer",
        ["export", "{tmp}/run", "{tmp}/tok", "--tokenizer", "{tmp}/tok"],
        apart("OUT", "{tmp}/tok", "is", "--tokenizer", "{tmp}/tok"),
        setup=steps(RUN, copy_asset("tokenizer", "tok"))),
    Bad("export gguf-lora into its base",
        ["export", "{adapter}", "{tmp}/base/a.gguf", "--format", "gguf-lora", "--base",
         "{tmp}/base"],
        apart("OUT", r"{tmp}/base/a\.gguf", "lies inside", "--base", "{tmp}/base"),
        setup=copy_asset("model", "base")),
    Bad("export gguf-lora into its adapter",
        ["export", "{tmp}/adapter", "{tmp}/adapter/a.gguf", *GGUF_LORA],
        apart("OUT", r"{tmp}/adapter/a\.gguf", "lies inside", "CHECKPOINT_DIR",
              "{tmp}/adapter"), setup=copy_asset("adapter")),
    Bad("export gguf onto a link into the model",
        ["export", "{tmp}/model", "{tmp}/m.gguf", *GGUF],
        apart("OUT", r"{tmp}/m\.gguf", "is", "CHECKPOINT_DIR", "{tmp}/model"),
        setup=steps(copy_asset("model"), link("m.gguf", "model"))),
    # lora merge: the base, the adapter
    Bad("lora merge over its base",
        ["lora", "merge", "--model", "{tmp}/model", "--adapter", "{adapter}", "--output",
         "{tmp}/model"],
        apart("--output", "{tmp}/model", "is", "--model", "{tmp}/model"),
        setup=copy_asset("model")),
    Bad("lora merge over its adapter",
        ["lora", "merge", "--model", "{model}", "--adapter", "{tmp}/adapter", "--output",
         "{tmp}/adapter"],
        apart("--output", "{tmp}/adapter", "is", "--adapter", "{tmp}/adapter"),
        setup=copy_asset("adapter")),
    Bad("lora merge inside its base",
        ["lora", "merge", "--model", "{tmp}/model", "--adapter", "{adapter}", "--output",
         "{tmp}/model/merged"],
        apart("--output", "{tmp}/model/merged", "lies inside", "--model", "{tmp}/model"),
        setup=copy_asset("model")),
    Bad("lora merge to gguf onto the base's weights",
        ["lora", "merge", "--model", "{tmp}/model", "--adapter", "{adapter}", "--output",
         "{tmp}/model/model.safetensors", *GGUF],
        apart("--output", r"{tmp}/model/model\.safetensors", "lies inside", "--model",
              "{tmp}/model"), setup=copy_asset("model")),
    Bad("lora merge over a directory holding its base",
        ["lora", "merge", "--model", "{tmp}/m/model", "--adapter", "{adapter}", "--output",
         "{tmp}/m"],
        apart("--output", "{tmp}/m", "holds", "--model", "{tmp}/m/model"),
        setup=copy_asset("model", "m/model")),
    # the evaluations: the data, the model
    Bad("eval output onto its data", ["eval", "--model", "{model}", "--data", "{tmp}/c.txt",
                                      "--output", "{tmp}/c.txt"],
        apart("--output", r"{tmp}/c\.txt", "is", "--data", r"{tmp}/c\.txt"),
        setup=write("c.txt", "some text to score\n")),
    Bad("eval output onto a hard link of its data",
        ["eval", "--model", "{model}", "--data", "{tmp}/c.txt", "--output", "{tmp}/r.json"],
        apart("--output", r"{tmp}/r\.json", "is", "--data", r"{tmp}/c\.txt"),
        setup=steps(write("c.txt", "some text to score\n"), hard_link("r.json", "c.txt"))),
    Bad("eval output onto its indexed data's bin",
        ["eval", "--model", "{model}", "--data", "{tmp}/p", "--output", "{tmp}/p.bin"],
        apart("--output", r"{tmp}/p\.bin", "is", "--data", r"{tmp}/p\.bin"),
        setup=write("p.bin", b"\0" * 8)),
    Bad("eval output inside its data directory",
        ["eval", "--model", "{model}", "--data", "{tmp}/d", "--output", "{tmp}/d/r.json"],
        apart("--output", r"{tmp}/d/r\.json", "lies inside", "--data", "{tmp}/d"),
        setup=write("d/c.txt", "some text to score\n")),
    Bad("eval output onto the model's config",
        ["eval", "--model", "{tmp}/model", "--data", "{text}", "--output",
         "{tmp}/model/config.json"],
        apart("--output", r"{tmp}/model/config\.json", "lies inside", "--model",
              "{tmp}/model"), setup=copy_asset("model")),
    Bad("eval-sft output onto its data",
        ["eval-sft", "--model", "{model}", "--data", "{tmp}/chat.jsonl", "--output",
         "{tmp}/chat.jsonl"],
        apart("--output", r"{tmp}/chat\.jsonl", "is", "--data", r"{tmp}/chat\.jsonl"),
        setup=copy_asset("chat", "chat.jsonl")),
    Bad("lora eval output inside its adapter",
        ["lora", "eval", "--model", "{model}", "--adapter", "{tmp}/adapter", "--data",
         "{chat}", "--output", "{tmp}/adapter/adapter_config.json"],
        apart("--output", r"{tmp}/adapter/adapter_config\.json", "lies inside",
              "--adapter", "{tmp}/adapter"), setup=copy_asset("adapter")),
    Bad("bench-eval output inside its model",
        ["bench-eval", "--model", "{tmp}/model", "--tasks", "t", "--output",
         "{tmp}/model/r.json"],
        apart("--output", r"{tmp}/model/r\.json", "lies inside", "--model", "{tmp}/model"),
        setup=copy_asset("model")),
    # the recipe
    Bad("launch script over its config",
        ["launch", "slurm", "{tmp}/c.yaml", "--nodes", "1", "--gpus-per-node", "1",
         "--output", "{tmp}/c.yaml"],
        apart("--output", r"{tmp}/c\.yaml", "is", "CONFIG", r"{tmp}/c\.yaml"),
        setup=write("c.yaml", "train:\n  seed: 1\n")),
    Bad("generate output onto its prompts",
        [*GENERATE, "{tmp}/p.jsonl"],
        apart("--output", r"{tmp}/p\.jsonl", "is", "--prompts", r"{tmp}/p\.jsonl"),
        setup=PROMPTS),
    Bad("plan output over its config",
        ["plan", "{tmp}/c.yaml", "--gpus", "8", "--output", "{tmp}/c.yaml"],
        apart("--output", r"{tmp}/c\.yaml", "is", "CONFIG", r"{tmp}/c\.yaml"),
        setup=write("c.yaml", "train:\n  seed: 1\n")),
    # tokens and tokenizers
    Bad("preprocess bin a link to its input",
        ["preprocess", "--input", "{tmp}/c.jsonl", "--tokenizer", "{tokenizer}",
         "--output-prefix", "{tmp}/p"],
        apart("--output-prefix", r"{tmp}/p\.bin", "is", "--input", r"{tmp}/c\.jsonl"),
        setup=steps(write("c.jsonl", '{"text": "hi"}\n'), link("p.bin", "c.jsonl"))),
    Bad("preprocess idx a hard link of its input",
        ["preprocess", "--input", "{tmp}/c.jsonl", "--tokenizer", "{tokenizer}",
         "--output-prefix", "{tmp}/p"],
        apart("--output-prefix", r"{tmp}/p\.idx", "is", "--input", r"{tmp}/c\.jsonl"),
        setup=steps(write("c.jsonl", '{"text": "hi"}\n'), hard_link("p.idx", "c.jsonl"))),
    Bad("preprocess lock file a link into its tokenizer",
        ["preprocess", "--input", "{text}", "--tokenizer", "{tmp}/tok",
         "--output-prefix", "{tmp}/p"],
        apart("--output-prefix", r"{tmp}/p\.lock", "lies inside", "--tokenizer", "{tmp}/tok"),
        setup=steps(copy_asset("tokenizer", "tok"), link("p.lock", "tok/tokenizer.json"))),
    Bad("tokenizer output onto its input directory",
        ["tokenizer", "train", "--input", "{tmp}/d", "--vocab-size", "300", "--output",
         "{tmp}/d"],
        apart("--output", "{tmp}/d", "is", "--input", "{tmp}/d"),
        setup=write("d/c.txt", "some text\n")),
    Bad("tokenizer output holding its input file",
        ["tokenizer", "train", "--input", "{tmp}/d/c.txt", "--vocab-size", "300",
         "--output", "{tmp}/d"],
        apart("--output", "{tmp}/d", "holds", "--input", r"{tmp}/d/c\.txt"),
        setup=write("d/c.txt", "some text\n")),
]


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail, rather than hang for ever, if a writer blocks on a FIFO."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s: blocked on a FIFO?")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("row", params(SPECIAL_TARGETS + OWN_INPUTS))
def test_writers_input_is_refused_in_one_line(row, bad_input_assets, tmp_path, capsys,
                                              monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    with deadline(120):
        check_refused(row, bad_input_assets, tmp_path, capsys)


# ------------------------------------------------------------- stale temporaries


def dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_next_export_removes_a_killed_exports_temporaries_and_no_live_ones(
        bad_input_assets, tmp_path, capsys):
    host, out = socket.gethostname(), tmp_path / "merged"
    stale_dir = tmp_path / f".merged.tmp-{host}-{dead_pid()}-0123abcd"  # a killed export
    (stale_dir / "hf").mkdir(parents=True)
    (stale_dir / "hf" / "model.safetensors").write_bytes(b"\0" * 4096)
    stale_file = tmp_path / f".merged.tmp-{host}-{dead_pid()}-4567cdef"
    stale_file.write_bytes(b"\0" * 4096)
    kept = [tmp_path / f".merged.tmp-{host}-{os.getpid()}-89abcdef",  # a live process's
            tmp_path / f".merged.tmp-another-host-{dead_pid()}-0000aaaa",  # not ours to judge
            tmp_path / f".other.tmp-{host}-{dead_pid()}-1111bbbb"]  # another target's
    for path in kept:
        path.mkdir()
    code = main(["lora", "merge", "--model", str(bad_input_assets["model"]), "--adapter",
                 str(bad_input_assets["adapter"]), "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    assert (out / "config.json").is_file()
    assert not stale_dir.exists() and not stale_file.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["merged"] + [p.name for p in kept])


def test_the_next_gguf_export_removes_a_killed_ones_temporaries(bad_input_assets, tmp_path,
                                                                capsys):
    pytest.importorskip("gguf")
    host = socket.gethostname()
    stale = [tmp_path / f".m.gguf.tmp-{host}-{dead_pid()}-0123abcd",  # the half-written file
             tmp_path / f".m.gguf.tmp-{host}-{dead_pid()}-4567cdef"]  # the HF copy of a run
    stale[0].write_bytes(b"GGUF" + b"\0" * 4096)
    (stale[1] / "hf").mkdir(parents=True)
    live = tmp_path / f".m.gguf.tmp-{host}-{os.getppid()}-89abcdef"
    live.write_bytes(b"")
    code = main(["export", str(bad_input_assets["model"]), str(tmp_path / "m.gguf"), *GGUF])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.gguf", live.name])


def test_the_next_preprocess_removes_a_killed_ones_temporaries(bad_input_assets, tmp_path,
                                                               capsys):
    host = socket.gethostname()
    stale = [tmp_path / f"p.{ext}.tmp-{host}-{dead_pid()}" for ext in
             ("bin", "idx", "lengths", "docs", "pair")]
    live = tmp_path / f"p.bin.tmp-{host}-{os.getppid()}"
    for path in stale + [live]:
        path.write_bytes(b"\0" * 64)
    code = main(["preprocess", "--input", str(bad_input_assets["text"]), "--tokenizer",
                 str(bad_input_assets["tokenizer"]), "--output-prefix", str(tmp_path / "p")])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["p.bin", "p.idx", "p.pair", live.name])


def test_a_fifo_beside_the_output_named_like_a_temporary_is_removed_not_opened(tmp_path):
    stale = tmp_path / f".out.json.tmp-{socket.gethostname()}-{dead_pid()}-0123abcd"
    os.mkfifo(stale)
    with deadline(30):
        fsio.atomic_write_bytes(tmp_path / "out.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
