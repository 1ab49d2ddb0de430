"""The memory budget a run is checked against: the host's available memory on the CPU
(MemAvailable, a container's cgroup limit, shared by torchrun's local processes), and the
rule that refuses only an estimate that exceeds it by more than the estimate's error."""
import re
from types import SimpleNamespace

import pytest
import torch

from lmforge.config import load_config
from lmforge.perf import budget as B
from lmforge.perf.estimate import GiB
from lmforge.perf.estimate_setup import setup_from_config


def _host(monkeypatch, tmp_path, meminfo_kb=None, cgroup=None):
    """Points the budget at fake /proc/meminfo and cgroup files."""
    meminfo = tmp_path / "meminfo"
    if meminfo_kb is not None:
        meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
    monkeypatch.setattr(B, "MEMINFO", meminfo)
    files = []
    if cgroup is not None:
        (tmp_path / "max").write_text(cgroup[0] + "\n")
        (tmp_path / "current").write_text(cgroup[1] + "\n")
        files = [(tmp_path / "max", tmp_path / "current")]
    monkeypatch.setattr(B, "CGROUP_FILES", files)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_cpu_budget_is_memavailable_shared_by_torchruns_local_processes(
        monkeypatch, tmp_path):
    _host(monkeypatch, tmp_path, meminfo_kb=8 * 2**20)  # 8 GiB available
    alone = B.device_budget(torch.device("cpu"))
    assert alone.bytes == 8 * GiB and "MemAvailable" in alone.source
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    shared = B.device_budget(torch.device("cpu"))
    assert shared.bytes == 2 * GiB and "4" in shared.source


def test_a_containers_cgroup_limit_caps_the_cpu_budget(monkeypatch, tmp_path):
    _host(monkeypatch, tmp_path, meminfo_kb=64 * 2**20,
          cgroup=(str(6 * GiB), str(2 * GiB)))  # limit 6 GiB, 2 GiB used
    capped = B.device_budget(torch.device("cpu"))
    assert capped.bytes == 4 * GiB and "cgroup" in capped.source
    _host(monkeypatch, tmp_path, meminfo_kb=64 * 2**20, cgroup=("max", str(GiB)))
    assert B.device_budget(torch.device("cpu")).bytes == 64 * GiB  # "max": no limit


def test_without_meminfo_the_budget_falls_back_to_sysconf(monkeypatch, tmp_path):
    _host(monkeypatch, tmp_path)  # no meminfo file
    monkeypatch.setattr(B.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 1024,
                                                        "SC_PAGE_SIZE": 4096}[name])
    fallback = B.device_budget(torch.device("cpu"))
    assert fallback.bytes == 4 * 2**20 and "sysconf" in fallback.source


def test_gpu_budget_is_the_devices_total_memory(monkeypatch):
    props = {1: SimpleNamespace(total_memory=80 * GiB, name="Test GPU")}
    monkeypatch.setattr(B.torch.cuda, "get_device_properties", lambda d: props[d.index])
    gpu = B.device_budget(torch.device("cuda", 1))
    assert gpu == B.Budget(80 * GiB, "the total memory of GPU 1 (Test GPU)")


@pytest.mark.parametrize("estimate_gib, fits", [(10.0, True), (10.5, True), (10.6, False)])
def test_only_an_estimate_over_budget_by_more_than_its_error_is_refused(estimate_gib, fits):
    # 10.5 GiB less the estimate's 5% error (9.975) fits 10 GiB; 10.6 (10.07) does not
    check = B.MemoryCheck(estimate_gib * GiB, "cpu", B.Budget(10 * GiB, "a test budget"))
    assert check.fits is fits
    assert ("does NOT fit" in check.describe()) is not fits


def test_on_gpus_the_refusal_names_the_fewest_devices_that_fit():
    cfg = load_config(None, ["model.preset=llama3-8b", "model.vocab_size=128256",
                             "data.seq_len=4096", "data.micro_batch_size=1",
                             "train.device=cuda"])
    est = B.estimate_memory(setup_from_config(cfg, world_size=1)).total_bytes / GiB
    options = B.changes(cfg, 1, "cuda", est, budget_gib=80.0)
    assert any(o.startswith("train.activation_checkpointing=full (") for o in options)
    more = [o for o in options if "GPUs with parallel.dp_shard=-1" in o]
    on_two = B.peak_gib(cfg, {"parallel.dp_shard": -1}, 2, "cuda")
    assert on_two * (1 - B.ESTIMATE_ERROR) > 80.0 and more[0].startswith("4 GPUs"), options
    # micro-batch 1 already, no init_from: nothing to suggest there
    assert not any(o.startswith(("data.micro_batch_size", "lora.")) for o in options)


@pytest.mark.parametrize("overrides, advice", [
    # nothing left to change on the CPU: the larger machine alone
    (["data.micro_batch_size=1", "train.activation_checkpointing=full"],
     r"try a machine with more memory, or set train\.skip_memory_check=true to run anyway$"),
    # one change: "X or a machine ..."
    (["data.micro_batch_size=1"], r"try train\.activation_checkpointing=full \(\d+\.\d GiB\) "
     r"or a machine with more memory, or set train\.skip_memory_check=true"),
    # two: "X, Y or a machine ..."
    ([], r"try data\.micro_batch_size=1 \(\d+\.\d GiB\), train\.activation_checkpointing=full "
     r"\(\d+\.\d GiB\) or a machine with more memory, or set train\.skip_memory_check=true"),
])
def test_the_memory_refusal_lists_its_alternatives_as_a_sentence(overrides, advice):
    from lmforge.job import resolve
    cfg = load_config(None, ["model.preset=llama3-8b", "model.vocab_size=128256",
                             "data.seq_len=4096", "train.device=cpu", *overrides])
    job = resolve(cfg)
    check = B.MemoryCheck(10_000 * GiB, "cpu", B.Budget(1 * GiB, "a test budget"))
    line = B.refusal(job, check)
    assert re.search(r"^memory: the run needs about 10000\.0 GiB per device \(lmforge "
                     r"estimate\) but a test budget is 1\.0 GiB; " + advice, line), line
