"""LoRA under tensor parallelism (stock Colwise/RowwiseParallel) and FSDP2, QLoRA under
FSDP2: two CPU processes over gloo, compared with the same model in one process."""
from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lmforge.config import LoraConfig
from lmforge.models.llama import FeedForward, LlamaArgs, build_llama, materialize
from lmforge.peft import (after_materialize, lora_layers, merge_lora, prepare_model_for_lora,
                          unmerge_lora)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=128,
                 max_seq_len=64)
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _adapted(module, cfg, seed):
    prepare_model_for_lora(module, cfg)
    torch.manual_seed(seed)
    materialize(module, "cpu") if hasattr(module, "init_weights") else module.to_empty(
        device="cpu")
    if not hasattr(module, "init_weights"):
        module.reset_parameters(0.05, 0.05)
    after_materialize(module, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in lora_layers(module).values():
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=g) * 0.1)
    return module


def _check_tp(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    cfg = LoraConfig(enabled=True, rank=4, alpha=8, targets="all-linear")
    with torch.device("meta"):
        ffn = FeedForward(ARGS)
    ffn = _adapted(ffn, cfg, seed=0)
    reference = copy.deepcopy(ffn)
    mesh = init_device_mesh("cpu", (WORLD,))
    parallelize_module(ffn, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                   "down_proj": RowwiseParallel()})
    x = torch.randn(2, 5, ARGS.dim, generator=torch.Generator().manual_seed(7))
    out, expected = ffn(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    expected.square().sum().backward()
    ref_params = dict(reference.named_parameters())
    for name, p in ffn.named_parameters():
        assert (p.grad is not None) == name.endswith(("lora_a", "lora_b")), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad,
                                       rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        merge_lora(ffn)
        torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-5)
        unmerge_lora(ffn)
        torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-5)


def _check_fsdp(rank, quantize):
    from torch.distributed.fsdp import fully_shard

    cfg = LoraConfig(enabled=True, rank=4, alpha=8, targets="all-linear", quantize=quantize)
    model = _adapted(build_llama(ARGS), cfg, seed=0)
    reference = copy.deepcopy(model)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    expected = F.cross_entropy(reference(inputs).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is not None) == name.endswith(("lora_a", "lora_b")), name
        if p.grad is not None:  # same batch on both ranks: the mean grad is the reference
            torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad,
                                       rtol=1e-4, atol=1e-6)


def _worker(rank, port, quantize):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _check_tp(rank)
        _check_fsdp(rank, None)
        _check_fsdp(rank, quantize)
    finally:
        dist.destroy_process_group()


def main() -> None:
    mp.start_processes(_worker, args=(_free_port(), "nf4"), nprocs=WORLD,
                       start_method="spawn")


@pytest.mark.slow  # two spawned processes: about 10 s on an idle 2-core CPU
@pytest.mark.skipif(sys.platform == "win32", reason="gloo over spawn on Linux/macOS only")
def test_lora_under_tensor_parallel_and_fsdp2_matches_one_process():
    # In a fresh interpreter: spawning workers from the pytest process leaves its OpenMP
    # pool slow for the tests that follow.
    src = str(Path(__file__).resolve().parents[3] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


if __name__ == "__main__":
    main()
