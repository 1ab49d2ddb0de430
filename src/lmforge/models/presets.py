"""Named model sizes (the published ones follow each model's released config.json), and
the architecture of a run: a preset with the config's ``model.*`` fields on top."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from lmforge.config import ConfigError, JobConfig, check_parallel_fits
from lmforge.models.llama import LlamaArgs, RopeScaling

_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)



def _shape(dim, n_layers, n_heads, ffn_dim, vocab_size, tie_embeddings) -> dict:
    return dict(dim=dim, n_layers=n_layers, n_heads=n_heads, ffn_dim=ffn_dim,
                vocab_size=vocab_size, tie_embeddings=tie_embeddings)


PRESETS: dict[str, LlamaArgs] = {
    # Test and demo sizes. "tiny" trains on 2 CPU cores in minutes.
    "debug": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259,
                       ffn_dim=176, max_seq_len=512),
    "tiny": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048,
                      ffn_dim=688, max_seq_len=1024, tie_embeddings=True),
    "small": LlamaArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000,
                       ffn_dim=1376, max_seq_len=2048),
    "llama2-7b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                           ffn_dim=11008, max_seq_len=4096),
    "llama2-13b": LlamaArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                            vocab_size=32000, ffn_dim=13824, max_seq_len=4096),
    "llama2-70b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                            ffn_dim=28672, max_seq_len=4096),
    "llama3-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                           ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                            vocab_size=128256, ffn_dim=28672, max_seq_len=8192,
                            rope_theta=500000.0),
    "llama3.1-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             vocab_size=128256, ffn_dim=14336, max_seq_len=131072,
                             rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING),
    "llama3.2-1b": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                             vocab_size=128256, ffn_dim=8192, max_seq_len=131072,
                             rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING,
                             tie_embeddings=True),
    "llama3.2-3b": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                             vocab_size=128256, ffn_dim=8192, max_seq_len=131072,
                             rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING,
                             tie_embeddings=True),
    "mistral-7b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                            ffn_dim=14336, max_seq_len=32768, family="mistral",
                            sliding_window=4096),
    **{name: LlamaArgs(**shape, n_kv_heads=kv, max_seq_len=max_len, rope_theta=1e6,
                       norm_eps=1e-6, family="qwen2", attention_bias=True)
       for name, shape, kv, max_len in (
           ("qwen2.5-0.5b", _shape(896, 24, 14, 4864, 151936, True), 2, 32768),
           ("qwen2.5-1.5b", _shape(1536, 28, 12, 8960, 151936, True), 2, 131072),
           ("qwen2.5-7b", _shape(3584, 28, 28, 18944, 152064, False), 4, 131072))},
    **{name: LlamaArgs(**shape, n_kv_heads=8, max_seq_len=40960, rope_theta=1e6,
                       norm_eps=1e-6, family="qwen3", explicit_head_dim=128, qk_norm=True)
       for name, shape in (
           ("qwen3-0.6b", _shape(1024, 28, 16, 3072, 151936, True)),
           ("qwen3-1.7b", _shape(2048, 28, 16, 6144, 151936, True)),
           ("qwen3-8b", _shape(4096, 36, 32, 12288, 151936, False)))},
}


def check_model_args(args: LlamaArgs, seq_len: Optional[int] = None) -> None:
    """Refuse shapes the model cannot have (heads, RoPE) or a sequence it cannot take."""
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: n_heads ({args.n_heads}) must be divisible "
                          f"by n_kv_heads ({args.n_kv_heads})")
    if args.explicit_head_dim is None and args.dim % args.n_heads:
        raise ConfigError(f"model.n_heads: dim ({args.dim}) must be divisible by "
                          f"n_heads ({args.n_heads})")
    if args.head_dim % 2:
        raise ConfigError(f"model.n_heads: head_dim ({args.head_dim}) must be even for RoPE")
    if seq_len is not None and seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len: {seq_len} exceeds the model's max_seq_len "
                          f"({args.max_seq_len})")


_ARG_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
               "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings")


def model_args(cfg: JobConfig, base: Optional[LlamaArgs] = None) -> LlamaArgs:
    """The model architecture: a preset (or ``base``, e.g. read from config.json) with the
    fields set in ``model.*`` on top."""
    args = base if base is not None else PRESETS[cfg.model.preset]
    changes = {k: getattr(cfg.model, k) for k in _ARG_FIELDS if getattr(cfg.model, k) is not None}
    if "n_heads" in changes and "n_kv_heads" not in changes and args.n_kv_heads == args.n_heads:
        changes["n_kv_heads"] = changes["n_heads"]
    return dataclasses.replace(args, **changes)


def validate_job(cfg: JobConfig, world_size: int = 1, distributed: bool = False) -> JobConfig:
    """Everything refused before any compute: the config's own fields
    (``JobConfig.validate``) and the model section, which needs the presets."""
    cfg.validate(world_size=world_size, distributed=distributed)
    _validate_model(cfg)
    return cfg


def _validate_model(cfg: JobConfig) -> None:
    m = cfg.model
    if m.preset is not None and m.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {m.preset!r} "
                          f"(known: {', '.join(sorted(PRESETS))})")
    if m.preset is None and m.init_from is None:
        raise ConfigError("model.preset: set a preset or model.init_from")
    if m.init_from is not None:  # shape checks against config.json: when it is read
        if not Path(m.init_from).is_dir():
            raise ConfigError(f"model.init_from: {m.init_from} is not a directory")
        return
    args = model_args(cfg)
    check_model_args(args, cfg.data.seq_len)
    check_parallel_fits(cfg, args)
