"""Helpers to run `lmforge train` in fresh processes (one, or several under torchrun).
The ``tiny_corpus`` fixture is re-exported by the conftest files that use it."""
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lmforge
from lmforge.data.tokenizer import train_bpe

from helpers.tiny_models import tiny_model_overrides

WORKER = Path(__file__).with_name("patched_worker.py")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A generated text file and a 301-token BPE tokenizer trained on it."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "tensor", "pipeline", "shard", "mesh",
             "token", "layer", "norm", "rotary", "loss", "grad", "step", "rank"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15)))
             for _ in range(600)]
    (root / "corpus.txt").write_text("\n".join(lines))
    train_bpe(lines, vocab_size=301).save(root / "tok")
    return root


def tiny_overrides(corpus: Path, steps: int) -> list[str]:
    """The tiny model (4 layers, so pp=2 x 2 virtual stages has one each; the corpus
    tokenizer's 301 ids, which tp=2 does not divide) trained ``steps`` steps on the corpus."""
    return [*tiny_model_overrides(n_layers=4, vocab_size=301, tie_embeddings=False),
            f"model.tokenizer={corpus / 'tok'}", "data.kind=text",
            f"data.path={corpus / 'corpus.txt'}", "data.eval_fraction=0", "data.seq_len=32",
            "data.micro_batch_size=2", "data.global_batch_size=8",
            f"train.max_steps={steps}", "train.log_every=1", "optim.lr=1e-2",
            "optim.warmup_steps=0", "optim.grad_clip=0.5", "train.sample_tokens=1"]


def launch_worker(worker: Path, out: Path, nproc: int, timeout: int = 300,
                  args: tuple[str, ...] = ()) -> None:
    """``torchrun --standalone --nproc-per-node=nproc worker out *args`` with src/ importable and
    one thread per process, as the distributed tests' workers run; asserts it succeeded
    (the output's end in the message otherwise)."""
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(src), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(worker), str(out), *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def run_lmforge(out, overrides, nproc=1, fault=None, check=True, timeout=600, **popen):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if fault:
        env["LMFORGE_TEST_FAULT"] = fault
    env.update(popen.pop("env", {}))
    entry = [str(WORKER)] if fault else ["-m", "lmforge.cli"]
    args = ["train", *overrides, f"train.output_dir={out}"]
    torchrun_args = popen.pop("torchrun_args", [])  # e.g. the SLURM script's
    if nproc == 1 and not popen.pop("torchrun", False):
        cmd = [sys.executable, *entry, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *torchrun_args, *entry, *args]
    if popen.pop("background", False):
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def run_example(script: str, out: Path, timeout: int, **env) -> Path:
    """``bash examples/<script>`` from the repository root with this venv's lmforge on the
    PATH, OUT=``out`` and ``env`` (its step counts, shortened); asserts it succeeds."""
    root = Path(__file__).resolve().parents[2]
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "OUT": str(out), "PATH": bin_dir + os.pathsep + os.environ["PATH"],
           "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in env.items()}}
    proc = subprocess.run(["bash", f"examples/{script}"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out


def await_pid(ready: Path, proc, timeout: float = 300) -> int:
    """The pid a patched worker wrote to ``ready`` (LMFORGE_TEST_SIGNAL) on reaching the
    point it waits at; fails if ``proc`` ends first."""
    deadline = time.time() + timeout
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"the trainer never wrote {ready}"
        time.sleep(0.05)
    return int(ready.read_text())


def has_lmforge_frame(stderr: str) -> bool:
    """Whether ``stderr`` holds a traceback frame of lmforge's own code (torchrun's own
    traceback does not count). Matched by the package's real path: the checkout's folder
    may well be called lmforge, and so may the virtual environment's."""
    package = Path(os.path.abspath(lmforge.__file__)).parent
    return any(f'File "{path}{os.sep}' in stderr for path in (package, package.resolve()))


def free_port() -> int:
    """A TCP port nothing listens on now (a rendezvous, a server the test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def weights_digest(out: Path) -> str:
    """A run's exported weights (``out/hf/model.safetensors``) as one SHA-256: the tensors'
    names and bytes, in name order."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    sd = load_file(out / "hf" / "model.safetensors")
    h = hashlib.sha256()
    for key in sorted(sd):
        h.update(key.encode())
        h.update(sd[key].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
