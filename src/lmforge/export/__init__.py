"""Export a trained model to Hugging Face / PEFT formats: from the live model at the end
of a run (``export_trained``) or offline, in one process, from a checkpoint saved on any
layout (``export_checkpoint``, behind ``lmforge export``).

Formats: ``hf`` (a directory ``transformers.AutoModelForCausalLM.from_pretrained``
loads), ``merged`` (the same with LoRA adapters merged in) and ``peft`` (an adapter in
PEFT layout). Every export keeps the tokenizer files, the chat template the run trained
with, and the template's end-of-turn token in ``generation_config.json``.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lmforge import fsio
from lmforge.checkpoint import (CONFIG_NAME, META_NAME, CheckpointError, find_checkpoint,
                                read_job_config, read_meta, read_model_state)
from lmforge.checkpoint.collective import describe
from lmforge.config import JobConfig
from lmforge.data.templates import get_template
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.models.common import materialize
from lmforge.models.hf import save_hf_model
from lmforge.models.presets import job_model_args
from lmforge.models.registry import args_from_dict, build_model
from lmforge.peft.adapters import export_merged, save_adapter
from lmforge.peft.lora import apply_lora, is_lora_param, prepare_model_for_lora
from lmforge.peft.quant import quantize_base

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ("hf", "peft", "merged")


def chat_export(cfg: Optional[JobConfig], tokenizer: Optional[Tokenizer]):
    """(tokenizer, generation_config) for an export: the chat template the run trained
    with (an SFT run's ``data.template``; else the tokenizer's own) goes into the
    tokenizer files when it is Jinja, and its end-of-turn token into ``eos_token_id``, so
    ``generate`` stops where the template ends a reply."""
    if tokenizer is None:
        return None, None
    sft = cfg is not None and cfg.data.kind == "sft"
    try:
        template = get_template(cfg.data.template if sft else "auto", tokenizer)
        eot = template.end_of_turn_id(tokenizer)
    except ValueError as e:  # DataError: a template that cannot end a reply
        if sft:
            raise
        warnings.warn(f"export: the tokenizer's chat template is left as it is, without an "
                      f"end-of-turn token in generation_config.json ({e})", stacklevel=2)
        return tokenizer, None
    if template.source is not None:
        tokenizer = tokenizer.with_chat_template(template.source)
    if eot == tokenizer.eos_id:
        return tokenizer, None
    return tokenizer, {"eos_token_id": [i for i in (tokenizer.eos_id, eot) if i is not None]}


# ------------------------------------------------------------- from the live model

def trained_model(args, full_sd: dict, lora_cfg=None) -> nn.Module:
    """A single-device CPU model holding the trained weights (``full_sd``, gathered from
    a sharded or pipelined model), with LoRA layers when ``lora_cfg`` is enabled."""
    plain = build_model(args)
    if lora_cfg is not None and lora_cfg.enabled:
        prepare_model_for_lora(plain, lora_cfg)
    materialize(plain, "cpu", init=False)
    plain.load_state_dict(full_sd, strict=True)
    return plain


def export_trained(cfg: JobConfig, model: nn.Module, tokenizer: Tokenizer, out_dir: Path) -> None:
    """``hf/``: a transformers-loadable model (adapters merged in); with LoRA also
    ``adapter/`` in PEFT layout. Chat templates stop on their end-of-turn token."""
    tokenizer, generation = chat_export(cfg, tokenizer)
    if not cfg.lora.enabled:
        save_hf_model(model, out_dir / "hf", tokenizer=tokenizer, generation_config=generation)
        return
    save_adapter(model, out_dir / "adapter", base_model_path=cfg.model.init_from,
                 lora_cfg=cfg.lora)
    # A base stored in bf16 (frozen weights under bf16 compute) is exported in bf16.
    bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters())
    export_merged(model, out_dir / "hf", tokenizer=tokenizer, generation_config=generation,
                  dtype=torch.bfloat16 if bf16 else None)


# --------------------------------------------------------------- from a checkpoint

def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, fmt: str = "hf",
                      tokenizer_dir: Optional[str | Path] = None,
                      dtype: Optional[str] = None) -> Path:
    """Offline, single process: a checkpoint -> a Hugging Face model directory (``hf``;
    ``merged`` = the same with LoRA adapters merged in) or a PEFT adapter (``peft``).
    The tokenizer comes from ``tokenizer_dir``, else the run's ``tokenizer/`` beside
    ``checkpoints/``, else the job config's tokenizer or init_from directory."""
    if fmt not in FORMATS:
        raise CheckpointError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype: {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    fsio.check_writable(out_dir, "OUT_DIR", kind="dir")
    path = find_checkpoint(ckpt_dir)
    # The small config first: a bad one is refused before the tensors are read.
    cfg = read_job_config(path) if (path / CONFIG_NAME).is_file() else None
    sd = read_model_state(path)
    args = checkpoint_model_args(path, sd)
    source = _tokenizer_source(path, tokenizer_dir, cfg)
    tokenizer, generation = chat_export(cfg, load_tokenizer(source) if source else None)
    torch_dtype = EXPORT_DTYPES[dtype] if dtype else None
    lora_keys = [k for k in sd if is_lora_param(k)]
    if fmt == "peft" and not lora_keys:
        raise CheckpointError(f"{path}: --format peft needs LoRA parameters and this "
                              f"checkpoint has none (use --format hf)")
    if lora_keys:
        if fmt == "hf":
            raise CheckpointError(f"{path}: holds LoRA adapters ({lora_keys[0]}, ...): use "
                                  f"--format merged (full model) or --format peft (adapter)")
        return _export_lora(fmt, sd, args, cfg, Path(out_dir), tokenizer, path, torch_dtype,
                            generation)
    model = materialize(build_model(args), "cpu", init=False)
    _load_exact(model, sd, path)
    return save_hf_model(model, out_dir, tokenizer=tokenizer, dtype=torch_dtype,
                         generation_config=generation)


def checkpoint_model_args(ckpt_dir: str | Path, model_sd: Optional[dict] = None):
    """The architecture a checkpoint was saved with: meta.json's record, else rebuilt
    from config.yaml (vocabulary size read off the embedding)."""
    path = Path(ckpt_dir)
    recorded = read_meta(path).get("model_args") if (path / META_NAME).is_file() else None
    if recorded:
        return args_from_dict(recorded)
    cfg = read_job_config(path)
    vocab = None  # the embedding's rows, where the weights are at hand
    if model_sd is not None and "tok_embeddings.weight" in model_sd:
        vocab = model_sd["tok_embeddings.weight"].shape[0]
    args = job_model_args(cfg, vocab)
    return args if vocab is None else dataclasses.replace(args, vocab_size=vocab)


def _tokenizer_source(ckpt_dir: Path, tokenizer_dir, cfg) -> Optional[Path]:
    candidates = [tokenizer_dir] if tokenizer_dir else [
        ckpt_dir.parent.parent / "tokenizer",
        cfg.model.tokenizer if cfg else None, cfg.model.init_from if cfg else None]
    for candidate in candidates:
        if candidate and (Path(candidate) / "tokenizer.json").is_file():
            return Path(candidate)
    if tokenizer_dir:
        raise CheckpointError(f"{tokenizer_dir}: no tokenizer.json")
    return None


def _export_lora(fmt: str, sd: dict, args, cfg, out_dir: Path, tokenizer, path: Path,
                 dtype: Optional[torch.dtype], generation_config: Optional[dict]) -> Path:
    """Rebuild the LoRA model the checkpoint was saved from and write the adapter alone
    (``peft``) or merged into a plain HF model (``merged``)."""
    lora_cfg = getattr(cfg, "lora", None)
    if lora_cfg is None:
        raise CheckpointError(f"{path}: holds LoRA parameters but no lora section in its "
                              f"{CONFIG_NAME}")
    modules = sorted({k.rsplit(".", 1)[0] for k in sd if is_lora_param(k)})
    # Rank from the tensors themselves, so the rebuilt layers always fit the weights.
    lora_cfg = dataclasses.replace(lora_cfg, rank=sd[f"{modules[0]}.lora_a"].shape[0])
    model = build_model(args)
    apply_lora(model, lora_cfg, module_names=modules)
    quantized = bool(getattr(lora_cfg, "quantize", None))
    # A quantized base needs real (any) weights to quantize before its tensors load.
    materialize(model, "cpu", init=quantized)
    if quantized:
        quantize_base(model, lora_cfg.quantize, "all-linear")
    _load_exact(model, sd, path)
    if fmt == "peft":
        return save_adapter(model, out_dir, base_model_path=cfg.model.init_from,
                            lora_cfg=lora_cfg)
    return export_merged(model, out_dir, tokenizer=tokenizer, dtype=dtype,
                         generation_config=generation_config)


def _load_exact(model: nn.Module, sd: dict, path: Path) -> None:
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: model state does not match its config "
                              f"({describe(e)[:300]})") from None
