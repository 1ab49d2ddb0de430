"""Loss evaluation: the mean is over every valid token (not over batches), the model's
train/eval mode is restored, and evaluation data from text files or JSONL covers each
token once."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers.tiny_models import tiny_llama_args
from lmforge.data.tokenizer import train_bpe
from lmforge.eval.evaluate import eval_batches_for, evaluate
from lmforge.models.llama import build_llama, materialize
from lmforge.models.loss import IGNORE_INDEX

CPU = torch.device("cpu")


def tiny_model(vocab_size: int = 61) -> torch.nn.Module:
    torch.manual_seed(0)
    args = tiny_llama_args(vocab_size=vocab_size)
    return materialize(build_llama(args), "cpu")


def batch(seed: int, rows: int, seq: int, masked: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (rows, seq + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, :masked] = IGNORE_INDEX
    return {"input_ids": ids[:, :-1], "labels": labels}


def test_evaluate_is_the_mean_over_every_valid_token_of_all_batches():
    model = tiny_model()
    batches = [batch(0, 2, 16, masked=3), batch(1, 1, 16, masked=10)]
    with torch.no_grad():
        losses = [F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(),
                                  ignore_index=IGNORE_INDEX, reduction="sum")
                  for b in batches]
    tokens = 2 * 13 + 6
    loss, counted = evaluate(model, batches, CPU)
    assert counted == tokens
    assert loss == pytest.approx(float(sum(losses)) / tokens, rel=1e-5)


def test_evaluate_restores_training_mode_and_refuses_data_without_targets():
    model = tiny_model().train()
    evaluate(model, [batch(0, 1, 8, masked=0)], CPU)
    assert model.training
    with pytest.raises(ValueError, match="no valid tokens"):
        evaluate(model, [batch(0, 1, 8, masked=8)], CPU)


def test_text_files_and_jsonl_records_give_every_next_token_target_once(tmp_path):
    texts = ["the quick brown fox jumps over the lazy dog " * 3, "pack my box with jugs " * 4]
    tok = train_bpe(texts * 10, 300)
    (tmp_path / "docs").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "docs" / f"{i}.txt").write_text(text)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    tokens = sum(len(tok.encode(t)) for t in texts)

    def targets(batches) -> int:
        return sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)

    # text files: an EOD between files, none after the last; a stream of n tokens has
    # n - 1 next-token targets, however the windows fall
    from_text = list(eval_batches_for([str(tmp_path / "docs")], tok, 16, 2))
    assert targets(from_text) == tokens + (len(texts) - 1) - 1
    # JSONL documents (as the pretraining pipeline): each document ends with an EOD
    from_jsonl = list(eval_batches_for([str(jsonl)], tok, 16, 2, json_key="body"))
    assert targets(from_jsonl) == tokens + len(texts) - 1
    loss, counted = evaluate(tiny_model(tok.vocab_size), from_text, CPU)
    assert counted == targets(from_text) and math.isfinite(loss)


def test_no_text_files_to_evaluate_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no text files"):
        eval_batches_for([str(tmp_path)], None, 16, 2)
