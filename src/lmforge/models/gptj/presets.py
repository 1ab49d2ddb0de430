"""Named GPT-J sizes.

``gptj-6b`` is EleutherAI/gpt-j-6b's config.json: 6,050,882,784 parameters as
transformers' ``GPTJForCausalLM`` holds them. The 6,053,381,344 its model card states is
the count of the original mesh-transformer-jax code, which kept a copy of every replicated
tensor on each of its 8 model-parallel shards (7 extra copies of the 28 ln_1 weights and
biases, the 28 fc_out biases and ln_f: 2,465,792) and a bias per shard on its one-hot
embedding (8 x 4,096 = 32,768), folded away when the weights were converted:
tests/unit/models/test_families.py checks the difference term by term.
"""
from __future__ import annotations

from lmforge.config import ConfigError
from lmforge.models.gptj.model import GPTJArgs

PRESETS: dict[str, GPTJArgs] = {
    "gptj-6b": GPTJArgs(dim=4096, n_layers=28, n_heads=16, n_kv_heads=16, vocab_size=50400,
                        ffn_dim=16384, max_seq_len=2048, rotary_dim=64),
    # The same code path at test size: 50400 rows beside a 50257-token GPT-2 tokenizer as
    # the real model has, partial rotary, a head size tp 2 and 4 divide.
    "gptj-tiny": GPTJArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=50400,
                          ffn_dim=256, max_seq_len=512, rotary_dim=8),
}


def check_args(args: GPTJArgs) -> None:
    """What a GPT-J model refuses (the shared rules: ``models/presets.py``)."""
    if args.n_kv_heads != args.n_heads:
        raise ConfigError(f"model.n_kv_heads: GPT-J has no grouped-query attention; "
                          f"n_kv_heads ({args.n_kv_heads}) must equal n_heads ({args.n_heads})")
    if args.dim % args.n_heads:
        raise ConfigError(f"model.n_heads: dim ({args.dim}) must be divisible by "
                          f"n_heads ({args.n_heads})")
    if args.rotary_features > args.head_dim or args.rotary_features % 2:
        raise ConfigError(f"model.rotary_dim: {args.rotary_features} must be even and at "
                          f"most head_dim ({args.head_dim})")
