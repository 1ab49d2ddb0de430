"""Held-out evaluation under pipeline parallelism: train.eval_every fires mid-run (every
rank enters the forward-only schedule together), and the final held-out loss is that of
the exported model on the same batches."""
import pytest
import torch

from helpers.runs import read_metrics, run_lmforge, tiny_overrides
from lmforge.config import load_config
from lmforge.data.build import build_data
from lmforge.data.tokenizer import load_tokenizer
from lmforge.eval.evaluate import evaluate
from lmforge.models.hf import load_hf_model

pytestmark = pytest.mark.slow


def test_pipeline_parallel_run_evaluates_on_the_eval_every_schedule(tiny_corpus, tmp_path):
    out = tmp_path / "pp2"
    run_lmforge(out, tiny_overrides(tiny_corpus, 4) + [
        "parallel.pp=2", "data.eval_fraction=0.2", "train.log_every=3",
        "train.eval_every=2", "train.eval_batches=3"], nproc=2)
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    # 3 batches of 2 rows: one schedule pass of 8 rows (4 micro-batches of 2), padded
    assert records[-1]["eval_tokens"] == 3 * 2 * 32
    cfg = load_config(str(out / "config.yaml"), [])
    data = build_data(cfg, load_tokenizer(out / "hf"))
    model = load_hf_model(out / "hf", device=torch.device("cpu"))
    loss, tokens = evaluate(model, data.eval_batches(), torch.device("cpu"))
    assert tokens == records[-1]["eval_tokens"]
    assert loss == pytest.approx(records[-1]["eval_loss"], rel=1e-5)
