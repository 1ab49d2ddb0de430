"""bench-eval's generate_until decodes its requests in batches with the one decoder: each
continuation is what that context decodes alone, cut at its own ``until``."""
from __future__ import annotations

import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.data.tokenizer import train_bpe
from lmforge.eval.harness import _generate_until
from lmforge.models.generate import generate
from lmforge.models.llama import build_llama, materialize


def test_batched_continuations_equal_each_context_alone_cut_at_its_until():
    lines = [f"line {i} of tensors and shards" for i in range(50)]
    tok = train_bpe(lines, 280)
    torch.manual_seed(0)
    model = materialize(build_llama(tiny_llama_args(vocab_size=tok.vocab_size)), "cpu").eval()
    requests = [("line 3 of", {"max_gen_toks": 8}), ("tensors", {"max_gen_toks": 5}),
                ("line 12 of tensors and", {"max_gen_toks": 8, "until": ["s"]})]
    got = _generate_until(model, tok, requests, batch_size=2)
    for (context, kwargs), text in zip(requests, got):
        alone = generate(model, [tok.encode(context)], kwargs["max_gen_toks"],
                         stop_ids=tuple(tok.eos_ids))[0].ids
        expected = tok.decode(alone)
        for stop in kwargs.get("until", []):
            expected = expected.split(stop)[0]
        assert text == expected
