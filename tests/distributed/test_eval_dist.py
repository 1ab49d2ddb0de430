"""Held-out evaluation on several processes: under pipeline parallelism train.eval_every
fires mid-run (every rank enters the forward-only schedule together); under data
parallelism the loss is that of every rank's held-out share together; either way it is
the exported model's loss on the same batches."""
import json

import pytest
import torch

from helpers.runs import read_metrics, run_lmforge, tiny_overrides
from lmforge.config import load_config
from lmforge.data.build import build_data
from lmforge.data.tokenizer import load_tokenizer
from lmforge.data.preprocess import preprocess
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


def test_data_parallel_eval_loss_is_that_of_every_ranks_held_out_share(tiny_corpus, tmp_path):
    lines = (tiny_corpus / "corpus.txt").read_text().splitlines()
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                 for t in lines))
    preprocess([tmp_path / "docs.jsonl"], tmp_path / "docs", tiny_corpus / "tok",
               append_eod=True)
    out = tmp_path / "dp2"
    run_lmforge(out, tiny_overrides(tiny_corpus, 2) + [
        "parallel.dp_shard=2", "data.kind=pretrain", f"data.path={tmp_path / 'docs'}",
        "data.eval_fraction=0.2", "train.eval_batches=2"], nproc=2)
    record = read_metrics(out)[-1]
    cfg = load_config(str(out / "config.yaml"), [])
    tokenizer = load_tokenizer(out / "hf")
    shares = [b for rank in (0, 1) for b in build_data(cfg, tokenizer, rank, 2,
                                                       out / "cache").eval_batches()]
    model = load_hf_model(out / "hf", device=torch.device("cpu"))
    loss, tokens = evaluate(model, shares, torch.device("cpu"))
    assert tokens == record["eval_tokens"] == 2 * 2 * 2 * 32  # 2 ranks x 2 batches of 2
    assert loss == pytest.approx(record["eval_loss"], rel=1e-5)
