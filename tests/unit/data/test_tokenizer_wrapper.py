"""Our tokenizer wrapper: training, saving, loading, special ids, and clear errors."""
import json

import pytest

from lmforge.data.tokenizer import TokenizerError, load_tokenizer, train_bpe

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n"] * 20


def test_trained_bpe_round_trips_text_and_has_special_ids(tmp_path):
    tok = train_bpe(TEXTS, vocab_size=300)
    text = "def add(x, y):\n    return x + y  # ünïcode\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.bos_id is not None and tok.eos_id is not None and tok.pad_id is not None
    # a byte-level tokenizer's post-processor adds no special token: neither do we
    assert tok.encode("x") == tok.encode("x", special_tokens=False)
    assert tok.affixes == ([], [])

    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode(text) == tok.encode(text)
    assert (again.bos_id, again.eos_id, again.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|end_of_text|>"


def test_trained_tokenizer_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = train_bpe(TEXTS, vocab_size=300)
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf("def add(a, b):", add_special_tokens=False)["input_ids"] == tok.encode(
        "def add(a, b):")
    assert hf.eos_token_id == tok.eos_id


def test_missing_or_corrupt_tokenizer_names_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json: not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: not a valid tokenizer"):
        load_tokenizer(tmp_path)
