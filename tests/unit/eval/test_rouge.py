"""ROUGE-L against hand-computed values, and the generate-then-score evaluation."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.data.tokenizer import train_bpe
from lmforge.eval.rouge import (corpus_rouge_l, evaluate_prompt_response, lcs_length,
                                prompt_ids, read_prompt_response, rouge_l, words)
from lmforge.models.llama import build_llama, materialize


def test_words_lowercase_and_split_on_non_alphanumerics():
    assert words("Anna & Ben'll meet at 3 PM, OK?") == ["anna", "ben", "ll", "meet", "at",
                                                        "3", "pm", "ok"]


def test_lcs_length_counts_the_longest_common_word_subsequence():
    assert lcs_length("a b c d e".split(), "a c e".split()) == 3
    assert lcs_length("a b".split(), "c d".split()) == 0
    assert lcs_length([], ["a"]) == 0
    assert lcs_length("b a b c".split(), "a b c b".split()) == 3


def test_rouge_l_and_corpus_mean_match_hand_computed_values():
    # LCS("the cat was found under the bed", "the cat was under the bed") = 6
    score = rouge_l("the cat was found under the bed", "the cat was under the bed")
    assert score.precision == pytest.approx(6 / 7) and score.recall == 1.0
    assert score.f1 == pytest.approx(12 / 13)
    assert rouge_l("Same words.", "same WORDS").f1 == 1.0
    assert rouge_l("", "anything").f1 == 0.0
    assert rouge_l("x y", "a b").f1 == 0.0
    assert corpus_rouge_l(["a b", "c"], ["a b", "d"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        corpus_rouge_l(["a", "b"], ["a"])


def test_read_prompt_response_reports_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\n{"prompt": 1}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: expected string"):
        read_prompt_response(path)
    assert len(read_prompt_response(path, limit=1)) == 1


def test_evaluate_prompt_response_scores_loss_and_rouge_of_a_tiny_model(tmp_path):
    records = [{"prompt": f"Dialogue:\nA: hi {i}\nSummary:", "response": f"A says hi {i}."}
               for i in range(5)]
    tok = train_bpe([json.dumps(r) for r in records] * 20, 300)
    args = tiny_llama_args(dim=64, vocab_size=tok.vocab_size, ffn_dim=176, norm_eps=1e-5)
    torch.manual_seed(0)
    model = materialize(build_llama(args), "cpu").eval()
    # plain template, a tokenizer that adds no BOS: the prompt text and its newline only
    assert prompt_ids(tok, records[0]["prompt"]) == tok.encode(records[0]["prompt"] + "\n")
    assert tok.decode(prompt_ids(tok, records[0]["prompt"])).endswith("Summary:\n")
    result = evaluate_prompt_response(model, tok, records, max_new_tokens=4, batch_size=2)
    assert result["samples"] == 5 and result["tokens"] > 5
    assert 0.0 <= result["rouge_l"] <= 1.0 and result["loss"] > 0
    assert len(result["examples"]) == 3
    assert torch.isfinite(torch.tensor(result["perplexity"]))
