"""A one-layer model and its optimizer, saved and checked the way the checkpoint tests
need it."""
from __future__ import annotations

import torch

from helpers.tiny_models import tiny_llama_args
from lmforge.checkpoint import checkpoint_step, list_checkpoints, load_checkpoint, save_checkpoint
from lmforge.models.llama import build_llama, materialize

ARGS = tiny_llama_args(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=32, ffn_dim=32,
                       max_seq_len=32)


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = materialize(build_llama(ARGS, "meta"), "cpu")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def save(root, step, model, optimizer, **kwargs):
    return save_checkpoint(root, step, model, optimizer, {"step": step}, None,
                           {"train": {"max_steps": 5}}, **kwargs)


def weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_loads(path, expected: dict):
    model, optimizer = make_model(seed=123)
    extra, _ = load_checkpoint(path, model, optimizer)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    return extra


def steps(root) -> list[int]:
    return [checkpoint_step(p) for p in list_checkpoints(root)]
