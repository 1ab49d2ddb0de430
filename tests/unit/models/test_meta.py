"""Meta's original checkpoints (params.json + consolidated.NN.pth): imports equal the
Hugging Face import of the same weights, one shard or several, and the q/k permutation
turns Meta's interleaved RoPE into our rotate-half one."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402

from helpers.hf_models import random_hf_llama  # noqa: E402
from lmforge.models.hf import HFCheckpointError, load_hf_model  # noqa: E402
from lmforge.models.llama import apply_rope, rope_cos_sin  # noqa: E402
from lmforge.models.llama.meta import (  # noqa: E402
    args_from_meta_params, load_meta_checkpoint, meta_ffn_dim, to_meta_state_dict)

VOCAB = 102  # even, so Meta-style row shards split it in two


def saved_hf_model(tmp_path: Path, name: str = "hf", **overrides):
    model = random_hf_llama(0, **{"vocab_size": VOCAB, **overrides})
    model.save_pretrained(tmp_path / name)
    return model, tmp_path / name


def meta_params(config: LlamaConfig, vocab_size: int) -> dict:
    return {"dim": config.hidden_size, "n_layers": config.num_hidden_layers,
            "n_heads": config.num_attention_heads, "n_kv_heads": config.num_key_value_heads,
            "vocab_size": vocab_size, "multiple_of": 32, "ffn_dim_multiplier": None,
            "norm_eps": config.rms_norm_eps, "rope_theta": 10000.0, "use_scaled_rope": False}


def split_meta_shards(sd: dict, n: int, embedding_dim: int) -> list[dict]:
    """Model-parallel split as Meta's code does it: column-parallel weights by rows,
    row-parallel ones by columns, norms replicated."""
    def split_dim(key):
        if key == "tok_embeddings.weight":
            return embedding_dim
        if key.endswith(("wo.weight", "w2.weight")):
            return 1
        if key.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight",
                         "output.weight")):
            return 0
        return None
    shards = [{} for _ in range(n)]
    for key, tensor in sd.items():
        dim = split_dim(key)
        parts = [tensor] * n if dim is None else tensor.chunk(n, dim=dim)
        for shard, part in zip(shards, parts):
            shard[key] = part.clone()
    return shards


def test_meta_ffn_dim_matches_released_models():
    assert meta_ffn_dim(4096, 256, None) == 11008  # llama2-7b
    assert meta_ffn_dim(5120, 256, None) == 13824  # llama2-13b
    assert meta_ffn_dim(8192, 4096, 1.3) == 28672  # llama2-70b, llama3-70b
    assert meta_ffn_dim(4096, 1024, 1.3) == 14336  # llama3-8b
    assert meta_ffn_dim(2048, 256, 1.5) == 8192  # llama3.2-1b


def test_meta_params_with_scaled_rope_give_llama31_scaling():
    args = args_from_meta_params({"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
                                  "vocab_size": 128256, "multiple_of": 1024,
                                  "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5,
                                  "rope_theta": 500000.0, "use_scaled_rope": True})
    assert args.ffn_dim == 14336 and args.rope_scaling.factor == 8.0
    assert args.rope_scaling.original_max_position_embeddings == 8192


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_meta_single_shard_import_equals_hf_import(tmp_path, tied):
    reference, path = saved_hf_model(tmp_path, tie_word_embeddings=tied)
    from_hf = load_hf_model(path)
    meta_dir = tmp_path / "meta"
    meta_dir.mkdir()
    torch.save(to_meta_state_dict(from_hf.state_dict(), from_hf.args),
               meta_dir / "consolidated.00.pth")
    (meta_dir / "params.json").write_text(json.dumps(meta_params(reference.config, VOCAB)))
    from_meta = load_meta_checkpoint(meta_dir)
    # params.json has no context length or init std; everything else must agree.
    assert from_meta.args == dataclasses.replace(
        from_hf.args, max_seq_len=from_meta.args.max_seq_len, init_std=from_meta.args.init_std)
    hf_sd, meta_sd = from_hf.state_dict(), from_meta.state_dict()
    assert hf_sd.keys() == meta_sd.keys()
    assert all(torch.equal(hf_sd[k], meta_sd[k]) for k in hf_sd)
    assert (from_meta.output.weight is from_meta.tok_embeddings.weight) == tied


def test_meta_layout_differs_from_hf_layout_in_q_and_k_only(tmp_path):
    _, path = saved_hf_model(tmp_path)
    model = load_hf_model(path)
    meta = to_meta_state_dict(model.state_dict(), model.args)
    assert not torch.equal(meta["layers.0.attention.wq.weight"],
                           model.layers["0"].attention.q_proj.weight)
    assert torch.equal(meta["layers.0.attention.wv.weight"],
                       model.layers["0"].attention.v_proj.weight)


def meta_interleaved_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's reference RoPE: (seq, heads, head_dim) rotated as complex pairs (2i, 2i+1)."""
    seq, head_dim = x.shape[0], x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)  # (seq, head_dim/2)
    rotation = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x.reshape(seq, x.shape[1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rotation[:, None]).flatten(-2)


@torch.no_grad()
def test_meta_permutation_turns_interleaved_rope_into_rotate_half(tmp_path):
    """Attention scores from Meta's weights under Meta's RoPE equal ours under ours: checks
    the direction of the q/k permutation independently of our own inverse."""
    _, path = saved_hf_model(tmp_path, num_key_value_heads=2)
    model = load_hf_model(path)
    args, attention = model.args, model.layers["0"].attention
    meta = to_meta_state_dict(model.state_dict(), args)
    x = torch.randn(10, args.dim, generator=torch.Generator().manual_seed(3))
    wq, wk = meta["layers.0.attention.wq.weight"], meta["layers.0.attention.wk.weight"]
    q_meta = meta_interleaved_rope((x @ wq.T).view(10, 4, 16), 1e4)  # (seq, heads, hd)
    k_meta = meta_interleaved_rope((x @ wk.T).view(10, 2, 16), 1e4)  # (seq, kv_heads, hd)
    scores_meta = torch.einsum("qhd,khd->hqk", q_meta, k_meta.repeat_interleave(2, dim=1))

    cos, sin = rope_cos_sin(args, torch.arange(10)[None])
    q = apply_rope(attention.q_proj(x).view(1, 10, 4, 16).transpose(1, 2), cos, sin)[0]
    k = apply_rope(attention.k_proj(x).view(1, 10, 2, 16).transpose(1, 2), cos, sin)[0]
    scores = torch.einsum("hqd,hkd->hqk", q, k.repeat_interleave(2, dim=0))
    torch.testing.assert_close(scores, scores_meta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("embedding_dim", [1, 0], ids=["llama2_embedding_by_columns",
                                                        "llama3_embedding_by_rows"])
def test_meta_two_shard_import_equals_hf_import(tmp_path, embedding_dim):
    reference, path = saved_hf_model(tmp_path, num_key_value_heads=2)
    from_hf = load_hf_model(path)
    meta_dir = tmp_path / "meta"
    meta_dir.mkdir()
    meta_sd = to_meta_state_dict(from_hf.state_dict(), from_hf.args)
    for i, shard in enumerate(split_meta_shards(meta_sd, 2, embedding_dim)):
        torch.save(shard, meta_dir / f"consolidated.{i:02d}.pth")
    # Llama 2's params.json says vocab_size -1: the loader reads it off the weights.
    (meta_dir / "params.json").write_text(json.dumps(meta_params(reference.config, -1)))
    from_meta = load_meta_checkpoint(meta_dir)
    assert from_meta.args.vocab_size == VOCAB
    hf_sd, meta_loaded = from_hf.state_dict(), from_meta.state_dict()
    assert all(torch.equal(hf_sd[k], meta_loaded[k]) for k in hf_sd)


def test_meta_checkpoint_without_params_json_is_named(tmp_path):
    (tmp_path / "meta").mkdir()
    with pytest.raises(HFCheckpointError, match=r"params\.json: not found"):
        load_meta_checkpoint(tmp_path / "meta")


class _Touch:
    """Unpickling this would create ``marker`` (what an attacker's command would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def test_a_pickled_payload_is_refused_without_advising_weights_only_false(tmp_path):
    model, _ = saved_hf_model(tmp_path)
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "params.json").write_text(json.dumps(meta_params(model.config, VOCAB)))
    marker = tmp_path / "pwned"
    torch.save({"tok_embeddings.weight": _Touch(marker)}, meta / "consolidated.00.pth")
    with pytest.raises(HFCheckpointError) as err:
        load_meta_checkpoint(meta)
    message = str(err.value)
    assert "consolidated.00.pth: cannot be read as a weights-only checkpoint (refused: the " \
           "pickle asks for posix.system" in message
    assert "weights_only" not in message.split("(", 1)[1] and "\n" not in message, message
    assert not marker.exists()
