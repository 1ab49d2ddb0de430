"""What bench/train_step.py and bench/generate.py share for a mixture of experts: a
preset of any family (``lmforge.models.registry.PRESETS``) with shape overrides applied
by ``dataclasses.replace``, one set of random weights written once (``save_hf_model``)
that both sides load, and each side's model and training loss.

lmforge's loss is ``accumulate_gradients`` with ``ExpertBalance``: cross-entropy +
router_aux_loss_coef x the load-balancing loss, as the trainer back-propagates it. The
reference is transformers' ``AutoModelForCausalLM`` from the same config.json, its
experts as ``experts_implementation`` says (grouped_mm: transformers 5's fastest, one
``torch._grouped_mm`` per projection), with ``output_router_logits=True``: cross-entropy +
router_aux_loss_coef x ``aux_loss``. Same weights, same loss to float rounding.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Optional

import torch

# flag (without --) -> the args field it replaces
SHAPE_FLAGS = {"dim": "dim", "layers": "n_layers", "heads": "n_heads",
               "kv_heads": "n_kv_heads", "head_dim": "explicit_head_dim",
               "ffn": "ffn_dim", "vocab": "vocab_size", "experts": "n_experts",
               "top_k": "top_k", "moe_ffn": "moe_ffn_dim"}
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
# peft's target_parameters for transformers 5's stacked experts (Qwen3-MoE, Mixtral)
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# lmforge's lora.targets that adapt the experts on an MoE (peft/targets.py)
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "experts", "mlp",
                  "experts.gate_up_proj", "experts.down_proj")


def add_shape_flags(parser: argparse.ArgumentParser, defaults: Optional[dict] = None) -> None:
    """``--dim --layers --heads --kv-heads --head-dim --ffn --vocab --experts --top-k
    --moe-ffn --dense-layers``: each, when given, replaces the preset's field."""
    group = parser.add_argument_group("shape overrides (replace the preset's fields)")
    for flag, field in SHAPE_FLAGS.items():
        group.add_argument(f"--{flag.replace('_', '-')}", type=int,
                           default=(defaults or {}).get(flag), help=f"args.{field}")
    group.add_argument("--dense-layers", type=_layer_list, default=None,
                       help="layers with a dense MLP, by commas ('none': every layer sparse)")


def _layer_list(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices by commas or 'none', "
                                         f"got {text!r}") from None


def model_args(preset: str, flags: argparse.Namespace, seq_len: int = 0):
    """The preset's args with the shape flags given in ``flags``, long enough for
    ``seq_len``, checked as a run's model would be."""
    from lmforge.models.presets import PRESETS, check_model_args

    args = PRESETS[preset]
    changes = {}
    for flag, field in SHAPE_FLAGS.items():
        value = getattr(flags, flag, None)
        if value is None:
            continue
        if not hasattr(args, field):
            raise SystemExit(f"--{flag.replace('_', '-')}: preset {preset}'s args "
                             f"({type(args).__name__}) have no field {field}")
        changes[field] = value
    if getattr(flags, "dense_layers", None) is not None:
        if not hasattr(args, "dense_layers"):
            raise SystemExit(f"--dense-layers: preset {preset}'s args have no dense_layers")
        changes["dense_layers"] = flags.dense_layers
    if seq_len > args.max_seq_len:
        changes["max_seq_len"] = seq_len
    args = dataclasses.replace(args, **changes)
    check_model_args(args)
    return args


def is_moe(args) -> bool:
    return getattr(args, "n_experts", 0) > 0


def describe(args) -> str:
    dense = getattr(args, "dense_layers", ())
    return (f"{args.family}: {args.n_layers} layers, dim {args.dim}, {args.n_heads} heads "
            f"({args.n_kv_heads} kv, head_dim {args.head_dim}), {args.n_experts} experts "
            f"top-{args.top_k} of width {args.moe_ffn_dim}"
            + (f", dense layers {list(dense)} of width {args.ffn_dim}" if dense else "")
            + f", vocab {args.vocab_size}")


def write_weights(args, out_dir: Path, seed: int = 0) -> Path:
    """lmforge's random initialisation (seeded), as an HF model directory both sides load."""
    from lmforge.models.common import materialize
    from lmforge.models.hf import save_hf_model
    from lmforge.models.registry import build_model

    torch.manual_seed(seed)
    model = materialize(build_model(args, "meta"), "cpu")
    return save_hf_model(model, out_dir)


# ------------------------------------------------------------------------ lmforge's side

def lmforge_model(args, device, weights_dir: Optional[str], lora=None,
                  frozen_bf16: bool = False, seed: int = 0):
    """lmforge's model on ``device``: built on meta, LoRA swapped in (``lora``: a
    LoraConfig), the frozen projections and experts in bf16 when ``frozen_bf16`` (the
    trainer's ``frozen_linears_to_bf16`` under bf16 compute; adapters, embeddings and
    norms stay fp32), then the weights of ``weights_dir`` (None: a seeded random
    initialisation)."""
    from lmforge.models.common import materialize
    from lmforge.models.hf import from_hf_state_dict, read_hf_state_dict
    from lmforge.models.registry import build_model
    from lmforge.peft import lora as L
    from lmforge.train.precision import frozen_linears_to_bf16

    model = build_model(args, "meta")
    if lora is not None:
        L.prepare_model_for_lora(model, lora)
        if frozen_bf16:  # (on the meta model: the fp32 copies are never allocated)
            frozen_linears_to_bf16(model)
    torch.manual_seed(seed)
    materialize(model, device, init=weights_dir is None)
    if weights_dir is not None:
        sd = from_hf_state_dict(read_hf_state_dict(weights_dir), args, source=weights_dir)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if unexpected or any("lora" not in k for k in missing):
            raise RuntimeError(f"{weights_dir}: missing {missing[:3]}, unexpected "
                               f"{unexpected[:3]}")
    if lora is not None:
        torch.manual_seed(seed + 1)
        L.after_materialize(model, lora)
    return model


def lmforge_moe_step(model, device, autocast, loss_chunk_tokens: int = 0):
    """One micro-batch's forward and backward as the trainer runs it; returns the loss
    back-propagated: cross-entropy + coef x aux (a float)."""
    from lmforge.train.balance import ExpertBalance
    from lmforge.train.step import accumulate_gradients

    def step(ids, labels):
        balance = ExpertBalance.of(model, 1)
        ce = accumulate_gradients(model, [{"input_ids": ids, "labels": labels}], device,
                                  autocast, loss_chunk_tokens=loss_chunk_tokens,
                                  balance=balance)
        return float(ce) + balance.coef * float(balance.aux_sum)
    return step


# ------------------------------------------------------------------- transformers' side

def reference_model(args, device, weights_dir: Optional[str], experts: str,
                    dtype: torch.dtype = torch.float32, seed: int = 0):
    """transformers' model of the same config.json: loaded from ``weights_dir``, or (None)
    built in ``dtype`` directly on ``device`` with its own random initialisation."""
    import transformers

    from lmforge.models.registry import hf_config_from_args

    if weights_dir is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            weights_dir, dtype=dtype, attn_implementation="sdpa",
            experts_implementation=experts).to(device)
    else:
        config = transformers.AutoConfig.for_model(**hf_config_from_args(args))
        config._attn_implementation = "sdpa"
        config._experts_implementation = experts
        torch.manual_seed(seed)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = transformers.AutoModelForCausalLM.from_config(config)
        finally:
            torch.set_default_dtype(default)
    used = model.config._experts_implementation
    if used != experts:
        raise RuntimeError(f"transformers chose experts_implementation={used!r}, "
                           f"not {experts!r}")
    return model


def reference_lora(model, rank: int, attention: list[str], experts: bool = True):
    """peft's LoRA as its users put it on transformers 5's MoE: the attention's
    projections as target_modules, the stacked experts as target_parameters (what
    lmforge's ``all-linear``, or Llama's seven names, adapt on an MoE; the router and
    dense layers' MLPs take none on either side)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=attention,
                             target_parameters=list(EXPERT_PARAMETERS) if experts else None)
    return peft.get_peft_model(model, config)


def reference_moe_step(forward, coef: float, autocast):
    """transformers' training loss with ``output_router_logits``: cross-entropy (sum over
    the tokens / their count) + coef x aux_loss; back-propagated, returned as a float."""
    def step(ids, labels):
        with autocast():
            out = forward(input_ids=ids, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(
            out.logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()
        loss = ce + coef * out.aux_loss
        loss.backward()
        return float(loss)
    return step
