"""metrics.jsonl and TensorBoard (read back with tensorboard's own reader); a real training
run writing them; throughput; the LoRA section as the FLOPs count
and the estimate read it."""
import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmforge.perf.flops import flops_per_token
from lmforge.perf.records import read_metrics
from lmforge.train import metrics as M

RUN_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu",
            "peak_mem_gib", "tokens")


def read_tensorboard(run_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_logger_writes_jsonl_and_tensorboard(tmp_path):
    logger = M.MetricsLogger(tmp_path)
    logger.log(1, {"loss": 2.5, "lr": 1e-3, "mfu": None, "tokens_per_s": 100.0,
                   "peak_mem_gib": 1.5, "grad_norm": torch.tensor(0.5), "note": "x"})
    logger.log(2, {"loss": 2.0, "lr": 1e-3, "mfu": 0.4, "tokens_per_s": 120.0,
                   "peak_mem_gib": 1.5, "grad_norm": 0.25, "loss_nan": float("nan")})
    logger.close()
    logger.close()  # closing twice is harmless
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["mfu"] is None and records[0]["grad_norm"] == 0.5
    scalars = read_tensorboard(tmp_path)
    assert scalars["loss/loss"] == [(1, 2.5), (2, 2.0)]
    assert scalars["perf/mfu"] == [(2, pytest.approx(0.4))]  # None is not written
    assert scalars["memory/peak_mem_gib"][0] == (1, 1.5)
    assert scalars["optim/lr"][1][0] == 2
    assert "train/loss_nan" not in scalars  # non-finite values stay out of TensorBoard


def test_a_resumed_logger_keeps_each_step_once(tmp_path):
    """A run killed after step 4 whose last checkpoint is step 2: the resumed invocation
    repeats steps 3-4, so their first records go (in metrics.jsonl and TensorBoard)."""
    first = M.MetricsLogger(tmp_path)
    for step in range(1, 5):
        first.log(step, {"loss": 10.0 + step})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # torn by the kill
    resumed = M.MetricsLogger(tmp_path, start_step=2)
    assert [r["step"] for r in resumed.earlier] == [1, 2]
    for step in range(3, 5):
        resumed.log(step, {"loss": 20.0 + step})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
        (1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
    assert read_tensorboard(tmp_path)["loss/loss"] == [(1, 11.0), (2, 12.0), (3, 23.0),
                                                       (4, 24.0)]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = M.MetricsLogger(tmp_path / "off", enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "off").exists()


def test_memory_metrics_on_cpu_give_the_resident_peak_and_no_reserved():
    mem = M.memory_metrics(torch.device("cpu"))
    assert mem["peak_mem_gib"] > 0 and mem["peak_reserved_gib"] is None


def test_a_training_run_writes_the_metrics(tmp_path):
    """A real (tiny) run: every logged step carries the metrics, and TensorBoard holds the
    same values as metrics.jsonl (MLflow and W&B: test_trackers.py)."""
    from lmforge.config import load_config
    from lmforge.train.loop import train

    corpus = tmp_path / "corpus.txt"
    words = "the quick brown fox jumps over a lazy dog while cats sleep".split()
    corpus.write_text("\n".join(" ".join(words[(i + j) % len(words)] for j in range(16))
                                for i in range(200)))
    out = tmp_path / "run"
    cfg = load_config(None, [
        "model.preset=debug", "data.kind=text", f"data.path={corpus}", "data.seq_len=32",
        "data.micro_batch_size=2", "data.tokenizer_vocab_size=259", "train.max_steps=3",
        "train.log_every=1", f"train.output_dir={out}", "train.sample_tokens=2",
        "train.progress_bar=false", "optim.warmup_steps=1", "train.device=cpu"])
    train(cfg)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        for key in RUN_KEYS:
            assert key in record, key
        assert record["tokens_per_s"] > 0 and record["tflops_per_device"] > 0
        assert record["mfu"] is None  # CPU: no peak, no MFU
    scalars = read_tensorboard(out)
    assert [s for s, _ in scalars["loss/loss"]] == [1, 2, 3]
    assert scalars["loss/loss"][-1][1] == pytest.approx(records[-1]["loss"], rel=1e-6)
    assert scalars["optim/grad_norm"][0][1] == pytest.approx(records[0]["grad_norm"], rel=1e-6)
    assert "perf/tokens_per_s" in scalars and "memory/peak_mem_gib" in scalars
    # TFLOP/s come from our count for the run's model (full training at seq 32)
    from lmforge.models.hf import args_from_hf_config

    args = args_from_hf_config(json.loads((out / "hf" / "config.json").read_text()))
    per_token = flops_per_token(args, 32)
    for record in records:
        assert record["tflops_per_device"] == pytest.approx(
            record["tokens_per_s"] * per_token / 1e12, rel=1e-9)


def test_throughput_reports_tokens_tflops_and_mfu(monkeypatch):
    clock = iter([0.0, 2.0] + [2.0] * 10)
    monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
    throughput = M.Throughput(flops_per_token=1e9, peak_flops=1e12, n_devices=2)
    throughput.add(4000)
    report = throughput.report()
    assert report["tokens_per_s"] == 2000
    assert report["tflops_per_device"] == pytest.approx(1.0)  # 2000 * 1e9 / 2 devices
    assert report["mfu"] == pytest.approx(1.0)
    assert M.Throughput(1e9, None).report()["mfu"] is None


def test_throughput_counts_the_flops_of_steps_shorter_than_seq_len(monkeypatch):
    """SFT batches as long as their longest sample: the step's FLOPs come with it (the
    attention of a shorter sequence costs less per token)."""
    clock = iter([0.0, 2.0] + [2.0] * 10)
    monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
    throughput = M.Throughput(flops_per_token=1e9, peak_flops=1e12, n_devices=2)
    throughput.add(3000, flops=2.4e12)
    throughput.add(1000)  # at flops_per_token
    report = throughput.report()
    assert report["tokens_per_s"] == 2000
    assert report["tflops_per_device"] == pytest.approx((2.4 + 1.0) / 2 / 2)
