"""The one tiny Llama of the test suite: its shape as ``LlamaArgs``, as ``model.*``
command-line overrides, and built (random weights, CPU). A test states only what it
needs to differ (``tiny_llama_args(vocab_size=tok.vocab_size)``), so the shape it does
not care about is defined here once."""
from __future__ import annotations

import torch

from lmforge.models.llama import Llama, LlamaArgs, build_llama, materialize

# Small enough for a CPU step in milliseconds; 4 heads over 2 KV heads keep grouped-query
# attention (and tp=2) exercised.
TINY_SHAPE = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64,
              "ffn_dim": 64, "max_seq_len": 64}


def tiny_llama_args(**overrides) -> LlamaArgs:
    """``LlamaArgs`` of the tiny shape, with ``overrides`` (any LlamaArgs field)."""
    return LlamaArgs(**{**TINY_SHAPE, **overrides})


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Llama:
    """A randomly initialised tiny Llama on the CPU (``seed`` fixes its weights)."""
    torch.manual_seed(seed)
    return materialize(build_llama(tiny_llama_args(**overrides)), "cpu").to(dtype)


def tiny_model_overrides(**overrides) -> list[str]:
    """The tiny shape as ``model.<field>=<value>`` overrides for ``lmforge train``."""
    shape = {**TINY_SHAPE, **overrides}
    return [f"model.{field}={str(value).lower() if isinstance(value, bool) else value}"
            for field, value in shape.items()]


def tiny_family_args() -> dict:
    """One tiny model per family and flag set, as the trainer builds them: id -> args.
    Mistral's window (6) is shorter than the tests' sequences; Qwen3 sizes its heads
    apart from dim; GPT-J rotates 8 of its 16 features per head."""
    from lmforge.models.gptj import GPTJArgs

    llama = tiny_llama_args(vocab_size=97)
    return {
        "llama": llama,
        "mistral": LlamaArgs(**{**llama.__dict__, "family": "mistral", "sliding_window": 6}),
        "qwen2": LlamaArgs(**{**llama.__dict__, "family": "qwen2", "attention_bias": True}),
        "qwen3": LlamaArgs(**{**llama.__dict__, "family": "qwen3", "qk_norm": True,
                              "explicit_head_dim": 12}),
        "gptj": GPTJArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=97,
                         ffn_dim=128, max_seq_len=64, rotary_dim=8),
    }
