"""Tiny Llamas (ours and transformers') and adapters with non-zero weights, so that an
adapter actually changes the logits: for the peft tests (``lib`` in tests/unit/peft) and
the LoRA commands' tests (tests/unit/cli)."""
from __future__ import annotations

import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.config import LoraConfig
from lmforge.models.llama import LlamaArgs, build_llama, materialize
from lmforge.peft import lora_layers
from helpers.hf_models import random_hf_llama

VOCAB = 96
# ffn_dim 176 is not a multiple of the NF4 block (64): the padded last block is exercised.
TINY = tiny_llama_args(dim=64, vocab_size=VOCAB, ffn_dim=176, norm_eps=1e-5)


def lora_cfg(**kw) -> LoraConfig:
    base = dict(enabled=True, rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    base.update(kw)
    return LoraConfig(**base)


def tiny_model(args: LlamaArgs = TINY, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return materialize(build_llama(args), "cpu").eval()


@torch.no_grad()
def randomize_adapters(model: torch.nn.Module, seed: int = 1, scale: float = 0.2) -> None:
    """Fresh adapters are a no-op (B = 0); give B (and A) values that matter."""
    g = torch.Generator().manual_seed(seed)
    for layer in lora_layers(model).values():
        layer.lora_a.copy_(torch.randn(layer.lora_a.shape, generator=g) * scale)
        layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=g) * scale)


def tokens(batch: int = 2, seq: int = 16, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def make_hf_llama(path, seed: int = 0, **overrides):
    """``TINY``'s shape as a random transformers Llama, saved to ``path``: (model, path)."""
    model = random_hf_llama(seed, **{"vocab_size": VOCAB, "intermediate_size": 176,
                                     "max_position_embeddings": 64, **overrides})
    model.save_pretrained(path)
    return model, path
