"""Distributed checkpoints on 2 CPU processes (torchrun, gloo).

1. FSDP2 (``fully_shard``) training saves sharded checkpoints, synchronously and
   asynchronously (training goes on while the write runs).
2. A single process loads the sharded checkpoint into a plain model + AdamW: weights and
   optimizer moments equal the full (gathered) state of the sharded run.
3. A 2-process FSDP2 run resumes from the async checkpoint and computes the same next
   loss as the run that never stopped; the same job loads a single-process checkpoint
   into FSDP2 and into tensor-parallel (DTensor) layouts.

This file is also the worker that torchrun starts (``python FILE MODE OUT_DIR``).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from lmforge.checkpoint import (AsyncCheckpointer, capture_rng, list_checkpoints,  # noqa: E402
                                load_checkpoint, read_model_state, restore_rng,
                                save_checkpoint)
from lmforge.config import OptimConfig  # noqa: E402
from lmforge.models.llama import LlamaArgs, build_llama, materialize  # noqa: E402
from lmforge.parallel import full_value  # noqa: E402
from lmforge.train.optim import build_optimizer, build_scheduler  # noqa: E402

ARGS = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=64,
                 max_seq_len=64)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2)
WORLD = 2


# --------------------------------------------------------------------------- worker

def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, 17),
                         generator=torch.Generator().manual_seed(1000 * step + rank))


def _plain(seed: int):
    torch.manual_seed(seed)
    model = materialize(build_llama(ARGS, "meta"), "cpu")
    optimizer = build_optimizer(model, OPTIM)
    return model, optimizer, build_scheduler(optimizer, OPTIM, 10)


def _fsdp(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = materialize(build_llama(ARGS, "meta"), "cpu")
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model, OPTIM)
    return model, optimizer, build_scheduler(optimizer, OPTIM, 10)


def _tensor_parallel(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(seed)
    model = materialize(build_llama(ARGS, "meta"), "cpu")
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    plan = {}
    for i in model.layers:
        for name in ("attention.q_proj", "attention.k_proj", "attention.v_proj",
                     "feed_forward.gate_proj", "feed_forward.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.attention.o_proj"] = RowwiseParallel()
        plan[f"layers.{i}.feed_forward.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    return model, build_optimizer(model, OPTIM)


def _step(model, optimizer, scheduler, step: int) -> float:
    import torch.distributed as dist

    tokens = _batch(step, dist.get_rank())
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def _full_state(model, optimizer) -> dict:
    """Gathered model + flattened optimizer state on every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optimizer": {k: v for k, v in osd.items() if torch.is_tensor(v)}}


def worker_train(out: Path) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    model, optimizer, scheduler = _fsdp(seed=0)
    weight = model.layers["0"].attention.q_proj.weight
    assert type(weight).__name__ == "DTensor", type(weight)
    losses = {}
    for step in (1, 2):
        losses[step] = _step(model, optimizer, scheduler, step)
    root = out / "checkpoints"
    extra = {"step": 2, "scheduler": scheduler.state_dict()}
    save_checkpoint(root, 2, model, optimizer, extra, capture_rng(), {"train": {}},
                    keep_last=3)
    ref = _full_state(model, optimizer)
    if rank == 0:
        torch.save(ref, out / "ref2.pt")

    checkpointer = AsyncCheckpointer(root, keep_last=3)
    assert checkpointer.use_async  # dcp.async_save works on gloo (its own group)
    losses[3] = _step(model, optimizer, scheduler, 3)
    ref3 = _full_state(model, optimizer)["model"]
    extra = {"step": 3, "scheduler": scheduler.state_dict()}
    assert checkpointer.save(3, model, optimizer, extra, capture_rng(), {"train": {}}) is None
    # Training goes on while the write runs; step 4 changes the parameters in place.
    losses[4] = _step(model, optimizer, scheduler, 4)
    checkpointer.maybe_finalize()
    losses[5] = _step(model, optimizer, scheduler, 5)
    checkpointer.wait()
    dist.barrier()
    steps = [p.name for p in list_checkpoints(root)]
    assert steps == ["step-0000002", "step-0000003"], steps
    assert read_model_state(root / "step-0000003").keys() == ref3.keys()
    for name, value in read_model_state(root / "step-0000003").items():
        assert torch.equal(value, ref3[name]), name  # the staged copy, not step 4's
    assert (root / "step-0000003" / f"rank-{rank:05d}.pt").is_file()
    _one_rank_fails(root, model, optimizer, rank)
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))


def _one_rank_fails(root: Path, model, optimizer, rank: int) -> None:
    """A full disk on rank 1 alone (in our files, then inside DCP's writer): every rank
    raises the same CheckpointError, nobody hangs, the good checkpoints stay."""
    import errno

    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    import lmforge.checkpoint as ckpt
    from lmforge import fsio

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for module, name in ((fsio, "write_file"), (fs, "_write_item")):
        real = getattr(module, name)
        if rank == 1:
            setattr(module, name, full)
        try:
            save_checkpoint(root, 9, model, optimizer, {}, capture_rng(), None, keep_last=1)
            raise AssertionError("the save should have failed")
        except ckpt.CheckpointError as e:
            assert "step-0000009" in str(e) and "No space left" in str(e), str(e)
        finally:
            setattr(module, name, real)
        dist.barrier()
        assert [p.name for p in list_checkpoints(root)] == ["step-0000002", "step-0000003"]
        assert not (root / "step-0000009.tmp").exists()
        dist.barrier()  # before rank 0 starts the next attempt


def worker_resume(out: Path) -> None:
    import torch.distributed as dist

    expected = {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}
    model, optimizer, scheduler = _fsdp(seed=1)
    extra, rank_state = load_checkpoint(out / "checkpoints" / "step-0000003", model, optimizer)
    assert rank_state is not None and extra["step"] == 3
    scheduler.load_state_dict(extra["scheduler"])
    restore_rng(rank_state)
    got = {step: _step(model, optimizer, scheduler, step) for step in (4, 5)}
    assert got == {4: expected[4], 5: expected[5]}, (got, expected)

    # A single-process checkpoint (saved by the test) into FSDP2 and into tensor parallel.
    ref = torch.load(out / "ref2.pt", weights_only=True)
    single = out / "single" / "step-0000002"
    for build in (_fsdp, lambda seed: _tensor_parallel(seed) + (None,)):
        model, optimizer, _ = build(seed=7)
        load_checkpoint(single, model, optimizer)
        for name, value in model.state_dict().items():
            assert torch.equal(full_value(value), ref["model"][name]), name
        state = _full_state(model, optimizer)["optimizer"]
        for name, value in ref["optimizer"].items():
            assert torch.equal(full_value(state[name]), value), name
    _integrity_on_two_ranks(out)
    dist.barrier()
    if dist.get_rank() == 0:
        (out / "resume-ok").write_text("ok")


def _integrity_on_two_ranks(out: Path) -> None:
    """Each rank hashed its own files into the manifest; the ranks share verification
    and agree: a bit flipped in rank 1's shard makes both fall back to the same step, a
    missing shard is named with the rank that wrote it."""
    import shutil
    import warnings

    import torch.distributed as dist

    from lmforge.checkpoint import CheckpointError, resolve_resume
    from lmforge.checkpoint.integrity import MANIFEST_NAME

    flipped, lost = out / "flipped", out / "lost"
    if dist.get_rank() == 0:
        shutil.copytree(out / "checkpoints", flipped)
        shard = flipped / "step-0000003" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x04
        shard.write_bytes(bytes(data))
        shutil.copytree(out / "checkpoints" / "step-0000002", lost / "step-0000002")
        (lost / "step-0000002" / "__1_0.distcp").unlink()
    dist.barrier()
    manifest = json.loads((flipped / "step-0000003" / MANIFEST_NAME).read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", "rank-00000.pt", "rank-00001.pt",
            ".metadata"} <= manifest.keys(), manifest.keys()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resolve_resume("auto", flipped) == flipped / "step-0000002"
    for path, cause in ((flipped / "step-0000003", "checksum mismatch in __1_0.distcp"),
                        (lost / "step-0000002",
                         "missing shard __1_0.distcp (written by rank 1)")):
        try:
            resolve_resume(str(path), path.parent)
            raise AssertionError(f"{path} should not verify")
        except CheckpointError as e:
            assert str(e) == f"train.resume: {path}: {cause}", str(e)


def _worker_main(mode: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        {"train": worker_train, "resume": worker_resume}[mode](Path(out))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- tests

def _torchrun(mode: str, out: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
           "--master-addr=127.0.0.1", f"--master-port={port}", __file__, mode, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {mode} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")


@pytest.mark.slow
def test_fsdp2_checkpoints_reshard_across_layouts(tmp_path):
    _torchrun("train", tmp_path)

    # 2 FSDP2 shards -> one process, plain model: weights and AdamW state identical.
    ref = torch.load(tmp_path / "ref2.pt", weights_only=True)
    model, optimizer, scheduler = _plain(seed=3)
    extra, rank_state = load_checkpoint(tmp_path / "checkpoints" / "step-0000002", model,
                                        optimizer)
    assert extra["step"] == 2 and rank_state is not None  # rank 0 had a file
    for name, value in model.state_dict().items():
        assert torch.equal(value, ref["model"][name]), name
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    _, osd = get_state_dict(model, optimizer,
                            options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert {k for k, v in osd.items() if torch.is_tensor(v)} == ref["optimizer"].keys()
    for name, value in ref["optimizer"].items():
        assert torch.equal(osd[name], value), name
    assert optimizer.param_groups[0]["lr"] > 0
    # Saved again from one process, for the 2-process job to reshard the other way.
    save_checkpoint(tmp_path / "single", 2, model, optimizer, extra, None, None)

    _torchrun("resume", tmp_path)
    assert (tmp_path / "resume-ok").is_file()


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2])
