"""``lmforge eval``: the result on stdout (a file only with --output), progress on stderr,
and --max-tokens scoring exactly that many tokens from the start of the data."""
import json

import pytest
import torch

from helpers.tiny_models import tiny_llama
from lmforge.cli import main
from lmforge.data.tokenizer import load_tokenizer, train_bpe
from lmforge.eval.evaluate import eval_batches_for, evaluate, limit_tokens
from lmforge.models.hf import save_hf_model

TEXT = "the quick brown fox jumps over the lazy dog and pack my box with jugs " * 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-cli")
    tok = train_bpe([TEXT] * 5, 200)
    save_hf_model(tiny_llama(vocab_size=tok.vocab_size), root / "model", tokenizer=tok)
    (root / "data.txt").write_text(TEXT)
    return root


def _eval(args, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # where the old default eval.json landed
    code = main(["eval", *args, "--seq-len", "16", "--batch-size", "2", "--device", "cpu"])
    assert code == 0
    return capsys.readouterr()


def test_eval_prints_json_and_writes_a_file_only_when_asked(model_dir, capsys, monkeypatch,
                                                            tmp_path):
    args = ["--model", str(model_dir / "model"), "--data", str(model_dir / "data.txt")]
    shown = _eval(args, capsys, monkeypatch, tmp_path)
    result = json.loads(shown.out)
    assert result["tokens"] > 0 and list(tmp_path.iterdir()) == []
    # what it is doing, on stderr (stdout stays the JSON alone)
    assert "loading" in shown.err and "evaluating on" in shown.err
    assert f"eval: {result['tokens']:,} tokens, loss {result['loss']:.4f}" in shown.err
    out = tmp_path / "sub" / "result.json"
    out.parent.mkdir()
    _eval(args + ["--output", str(out)], capsys, monkeypatch, tmp_path)
    assert json.loads(out.read_text()) == result


def test_eval_max_tokens_scores_exactly_the_first_tokens(model_dir, capsys, monkeypatch,
                                                         tmp_path):
    args = ["--model", str(model_dir / "model"), "--data", str(model_dir / "data.txt")]
    result = json.loads(_eval(args + ["--max-tokens", "21"], capsys, monkeypatch,
                              tmp_path).out)
    assert result["tokens"] == 21
    tok = load_tokenizer(model_dir / "model")
    model = tiny_llama(vocab_size=tok.vocab_size)
    batches = eval_batches_for([str(model_dir / "data.txt")], tok, 16, 2)
    first = next(batches)  # 2 rows x 16 targets: the 21st is row 1, position 4
    first["labels"][1, 5:] = -100
    expected, tokens = evaluate(model, [first], torch.device("cpu"))
    assert tokens == 21 and result["loss"] == pytest.approx(expected, rel=1e-6)


def test_limit_tokens_passes_everything_without_a_budget():
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long),
             "labels": torch.tensor([[1, -100, 2, 3], [4, 5, -100, 6]])}
    assert list(limit_tokens([batch], None)) == [batch]
    (cut,) = list(limit_tokens([batch, batch], 4))
    assert cut["labels"].tolist() == [[1, -100, 2, 3], [4, -100, -100, -100]]
