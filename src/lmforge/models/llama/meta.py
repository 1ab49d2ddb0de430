"""Meta's original Llama checkpoints (``params.json`` + ``consolidated.NN.pth``) ->
lmforge's ``Llama``: names, the merge of model-parallel shards, and the q/k row
permutation from Meta's interleaved RoPE layout to the rotate-half one we (and Hugging
Face) use. The same rules as ``models/hf.py``: every tensor used once, every target filled
with its shape; weights read through ``torch.load(weights_only=True)``, never by plain
unpickling.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from lmforge.fsio import torch_load_error
from lmforge.models.hf import load_into_model, param_shapes
from lmforge.models.llama.model import (Llama, LlamaArgs, RopeScaling, half_to_interleaved,
                                        interleaved_to_half)
from lmforge.models.mapping import (HFCheckpointError, check_finite, drop_tied_head,
                                    read_json, remap_state_dict, same_tensor)

_META_LAYER_NAMES = {  # Meta -> ours, inside layers.{i}
    "attention.wq.weight": "attention.q_proj.weight",
    "attention.wk.weight": "attention.k_proj.weight",
    "attention.wv.weight": "attention.v_proj.weight",
    "attention.wo.weight": "attention.o_proj.weight",
    "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
    "feed_forward.w3.weight": "feed_forward.up_proj.weight",
    "feed_forward.w2.weight": "feed_forward.down_proj.weight",
    "attention_norm.weight": "attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}
# Model-parallel shards: column-parallel weights split their output rows (dim 0),
# row-parallel ones their input columns (dim 1); norms are replicated. The embedding is
# split by columns in Llama 2 (ParallelEmbedding) and by rows in Llama 3
# (VocabParallelEmbedding): _merge_meta_shards tells them apart by shape.
_META_SHARD_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0,
                   "wo": 1, "w2": 1}


def meta_ffn_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """The SwiGLU hidden size Meta's code derives from params.json."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def args_from_meta_params(params: dict, vocab_size: Optional[int] = None,
                          tie_embeddings: bool = False,
                          source: str = "params.json") -> LlamaArgs:
    """params.json -> ``LlamaArgs``. Llama 2 writes vocab_size -1: pass the real one.
    params.json has no context length; the released one for the family is assumed."""
    try:
        dim, n_heads = int(params["dim"]), int(params["n_heads"])
        ffn_dim = meta_ffn_dim(dim, int(params.get("multiple_of", 256)),
                               params.get("ffn_dim_multiplier"))
        n_layers = int(params["n_layers"])
    except KeyError as e:
        raise HFCheckpointError(f"{source}: {e.args[0]} is missing") from None
    vocab = params.get("vocab_size", -1)
    vocab = vocab if vocab and vocab > 0 else vocab_size
    if vocab is None:
        raise HFCheckpointError(f"{source}: vocab_size is {params.get('vocab_size')} and "
                                f"could not be read from the weights")
    theta = float(params.get("rope_theta", 10000.0))
    scaling = None
    if params.get("use_scaled_rope"):
        scaling = RopeScaling(factor=float(params.get("rope_scaling_factor", 8.0)),
                              high_freq_factor=float(params.get("high_freq_factor", 4.0)))
    max_seq_len = params.get("max_seq_len") or (
        131072 if scaling else 8192 if theta >= 500000 else 4096)
    return LlamaArgs(dim=dim, n_layers=n_layers, n_heads=n_heads,
                     n_kv_heads=int(params.get("n_kv_heads") or n_heads), vocab_size=vocab,
                     ffn_dim=ffn_dim, max_seq_len=int(max_seq_len), rope_theta=theta,
                     rope_scaling=scaling, norm_eps=float(params.get("norm_eps", 1e-5)),
                     tie_embeddings=tie_embeddings)


def _meta_names(args: LlamaArgs) -> dict[str, str]:
    """Meta name -> ours (Meta checkpoints always carry output.weight)."""
    names = {"tok_embeddings.weight": "tok_embeddings.weight", "norm.weight": "norm.weight",
             "output.weight": "output.weight"}
    for i in range(args.n_layers):
        for meta, ours in _META_LAYER_NAMES.items():
            names[f"layers.{i}.{meta}"] = f"layers.{i}.{ours}"
    return names


def _permute_qk(sd: dict, args: LlamaArgs, fn) -> dict:
    out = dict(sd)
    for i in range(args.n_layers):
        q, k = f"layers.{i}.attention.q_proj.weight", f"layers.{i}.attention.k_proj.weight"
        out[q], out[k] = fn(sd[q], args.n_heads), fn(sd[k], args.n_kv_heads)
    return out


def from_meta_state_dict(sd: dict, args: LlamaArgs, source: str = "Meta state dict") -> dict:
    """Meta names and interleaved q/k -> ours. Tied: output.weight, when present, must
    equal the embedding."""
    sd = {k: v for k, v in sd.items() if k != "rope.freqs"}  # a buffer in Llama 1/2 files
    names = _meta_names(args)
    shapes = param_shapes(args)
    if args.tie_embeddings:
        sd = drop_tied_head(sd, "output.weight", "tok_embeddings.weight", True, source)
        del names["output.weight"]
    out = remap_state_dict(sd, names, {meta: shapes[ours] for meta, ours in names.items()}, source)
    check_finite(sd, source)
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return _permute_qk(out, args, interleaved_to_half)


def to_meta_state_dict(sd: dict, args: LlamaArgs) -> dict:
    """Ours -> Meta names and interleaved q/k (output.weight always written)."""
    if args.family != "llama":  # Meta's layout has no names for biases, q/k norms, windows
        raise HFCheckpointError(f"the Meta consolidated format holds Llama models only, "
                                f"not model_type {args.family!r}; export to HF instead")
    ours_to_meta = {ours: meta for meta, ours in _meta_names(args).items()}
    sd = _permute_qk(sd, args, half_to_interleaved)
    return {ours_to_meta.get(k, k): v for k, v in sd.items()}


def _merge_meta_shards(shards: list[dict], vocab_size: Optional[int]) -> dict:
    if len(shards) == 1:
        return dict(shards[0])
    merged = {}
    for key, first in shards[0].items():
        kind = key.split(".")[-2]  # wq, w1, output, tok_embeddings, ..._norm
        if key == "tok_embeddings.weight":
            # Llama 2 splits the embedding by columns, Llama 3 by rows.
            dim = 1 if vocab_size and first.shape[0] == vocab_size else 0
        else:
            dim = _META_SHARD_DIM.get(kind)
        parts = [s[key] for s in shards]
        merged[key] = first if dim is None or first.ndim < 2 else torch.cat(parts, dim=dim)
    return merged


def load_meta_checkpoint(ckpt_dir: str | Path, device: str | torch.device = "cpu",
                         dtype: Optional[torch.dtype] = None) -> Llama:
    """Meta's original layout (params.json + consolidated.NN.pth) -> ``Llama``."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise HFCheckpointError(f"{root}: checkpoint directory not found")
    params = read_json(root / "params.json", "a Meta checkpoint needs params.json")
    files = sorted(root.glob("consolidated.*.pth"))
    if not files:
        raise HFCheckpointError(f"{root}: no consolidated.*.pth files")
    shards = [_torch_load(p) for p in files]
    vocab = params.get("vocab_size", -1)
    if not vocab or vocab <= 0:  # Llama 2: read it off the (row-split) output layer
        vocab = sum(s["output.weight"].shape[0] for s in shards if "output.weight" in s) or None
    sd = _merge_meta_shards(shards, vocab)
    # Meta always writes output.weight; a copy of the embedding means a tied model.
    tied = ("output.weight" in sd and "tok_embeddings.weight" in sd
            and same_tensor(sd["output.weight"], sd["tok_embeddings.weight"]))
    args = args_from_meta_params(params, vocab, tied, source=str(root / "params.json"))
    sd = from_meta_state_dict(sd, args, source=f"{root} weights")
    return load_into_model(args, sd, device, dtype)


def _torch_load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # weights_only refuses arbitrary pickles; corrupt zips too
        raise HFCheckpointError(f"{path}: cannot be read as a weights-only checkpoint "
                                f"({torch_load_error(e)})") from None
