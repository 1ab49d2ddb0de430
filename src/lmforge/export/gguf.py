"""A Hugging Face model directory as one GGUF file, the format llama.cpp and Ollama run,
written with the ``gguf`` package (the GGUF library llama.cpp publishes; an optional
dependency, imported here only): ``export_gguf(model_dir, out, dtype)``.

What goes in:

* the family's architecture, shape keys and tensors (``models/<family>/gguf.py``; a
  family without one is refused before anything is written);
* the weights as ``f32``, ``f16``, ``bf16`` or ``q8_0`` (matrices; norms and other
  vectors stay f32, as llama.cpp's own converter keeps them, and a matrix whose rows are
  not whole q8_0 blocks of 32 is stored in f16);
* the keys llama.cpp's own converter (convert_hf_to_gguf.py) writes for the same
  directory: ``general.*`` (name, size label, model card, recommended sampling) by the
  gguf package's ``Metadata``, the architecture's shape keys, the file type;
* the tokenizer: a byte-level BPE vocabulary with its merges, token types (special
  added tokens are control tokens), the pre-tokenizer llama.cpp must apply (named by
  how the tokenizer splits a probe text, as the converter names it by what the tokenizer
  produces), BOS and whether to add it, as the tokenizer's post-processor does, and the
  unknown and padding tokens the tokenizer's files name;
* the chat template, and as EOS its end-of-turn token (``<|im_end|>``, ``<|eot_id|>``),
  so that llama.cpp and Ollama stop where the template stops.

The file is written beside its destination and moved into place once complete.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lmforge import fsio
from lmforge.checkpoint import find_checkpoint, model_tensor_metadata
from lmforge.config.errors import naming, show
from lmforge.data.tokenizer import load_tokenizer
from lmforge.models.hf import (from_hf_state_dict, load_hf_model, read_hf_config,
                               read_hf_state_dict, read_model_args, stop_token_ids)
from lmforge.models.registry import family_of
from lmforge.peft.adapter_spec import (ADAPTER_WEIGHTS, adapter_linears, adapter_pairs,
                                      check_against_base)
from lmforge.peft.adapters import export_merged, load_adapter, read_adapter_config
from lmforge.peft.lora import is_lora_param
from lmforge.export import export_checkpoint
from lmforge.export.gguf_tokenizer import (LLAMA3_SPLIT, QWEN2_SPLIT, GGUFError,  # noqa: F401
                                         _gguf, pre_tokenizer, write_tokenizer)

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")


def export_gguf(model_dir: str | Path, out: str | Path, dtype: str = "f16",
                name: Optional[str] = None) -> Path:
    """``model_dir`` (config.json, safetensors, tokenizer.json) as the GGUF file ``out``.
    The directory is checked as generate checks it (config.json against the weights'
    names and shapes, no NaN or Inf, generation_config.json, the tokenizer) before
    anything is written. ``name``: general.name (default: as llama.cpp's converter
    derives it, from the model card or the directory's name)."""
    gguf = _gguf()
    model_dir, out = Path(model_dir), Path(out)
    if dtype not in GGUF_DTYPES:
        raise GGUFError(f"--dtype: {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    args, family = gguf_family(model_dir)
    tokenizer = load_tokenizer(model_dir)
    pre = pre_tokenizer(model_dir)  # refuses a tokenizer llama.cpp would split otherwise
    hf_sd = checked_state_dict(model_dir, args)
    stop_token_ids(model_dir)  # (generation_config.json, checked as generate reads it)
    arch = family.gguf.architecture(args)
    with gguf_file(out, arch) as writer:
        name_map = gguf.get_tensor_name_map(_arch_enum(gguf, arch), args.n_layers)
        for gguf_name, tensor in family.gguf.tensors(hf_sd, args, name_map):
            _add_tensor(gguf, writer, gguf_name, tensor, dtype)
        # the keys in the order llama.cpp's converter writes them (the file holds them
        # apart from the tensors, whatever the order they were added in)
        write_general(writer, model_dir, name)
        family.gguf.write_hparams(writer, args)
        _add_head_size(writer, model_dir, args)
        writer.add_file_type(_file_type(gguf, dtype))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_tokenizer(writer, model_dir, tokenizer, args.vocab_size, pre)
    return out


def checked_state_dict(model_dir: Path, args) -> dict[str, torch.Tensor]:
    """The directory's tensors under their Hugging Face names, refused as generate refuses
    them: a name or shape config.json does not give, a missing tensor, NaN or Inf."""
    hf_sd = read_hf_state_dict(model_dir)
    weights = model_dir / ("model.safetensors" if (model_dir / "model.safetensors").is_file()
                           else "model.safetensors.index.json")
    from_hf_state_dict(hf_sd, args, source=str(weights))  # (its checks; the result unused)
    return hf_sd


def _add_head_size(writer, model_dir: Path, args) -> None:
    """key_length / value_length where config.json states head_dim, as llama.cpp's
    converter writes them (a family writes them itself where heads are not dim / n_heads)."""
    if read_hf_config(model_dir).get("head_dim") is None:
        return
    arch = writer.arch
    if f"{arch}.attention.key_length" not in writer.kv_data[0]:
        writer.add_key_length(args.head_dim)
        writer.add_value_length(args.head_dim)


def write_general(writer, model_dir: Path, name: Optional[str] = None) -> None:
    """``general.*`` as llama.cpp's converter writes them, by the gguf package's own
    ``Metadata`` (name, size label, base model, license, tags... from the model card
    (README.md) and the directory's name; recommended sampling from
    generation_config.json). Called once the tensors are added: the size label counts
    them."""
    gguf = _gguf()
    total, shared, expert, experts = writer.get_total_parameter_count()
    try:
        meta = gguf.Metadata.load(None, model_dir, name, total)
    except Exception as e:  # noqa: BLE001 (YAML's errors, and the heuristics' own)
        raise GGUFError(f"{model_dir / 'README.md'}: its model card cannot be read "
                        f"({_first_line(e)})") from None
    if meta.name is None:
        meta.name = model_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, experts)
    _check_metadata(meta, model_dir)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)


# generation_config.json's key for each sampling field the gguf package reads from it
_SAMPLING_KEYS = {"sampling_temp": "temperature", "sampling_penalty_last_n": "penalty_last_n"}


def _check_metadata(meta, model_dir: Path) -> None:
    """Every value read from the model card or generation_config.json has the type its
    GGUF key holds (a file is refused naming the field, not failed half-written)."""
    for field in dataclasses.fields(meta):
        value = getattr(meta, field.name)
        if value is None or _fits(value, str(field.type), field.name):
            continue
        if field.name.startswith("sampling_"):
            where = model_dir / "generation_config.json"
            key = _SAMPLING_KEYS.get(field.name, field.name.removeprefix("sampling_"))
        else:
            where, key = model_dir / "README.md", field.name
        raise GGUFError(f"{where}: {key}: {show(value, 60)} is not {_kind(str(field.type))}")


def _fits(value, annotation: str, field: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if "list[dict]" in annotation:
        return isinstance(value, list) and all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in value)
    if "list[str]" in annotation or field == "license" and isinstance(value, list):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if "int" in annotation:
        return number and isinstance(value, int) and -2**31 <= value < 2**31
    if "float" in annotation:
        return number and math.isfinite(value)
    return isinstance(value, str)


def _kind(annotation: str) -> str:
    for part, kind in (("list[dict]", "a list of mappings of strings"),
                       ("list[str]", "a list of strings"), ("int", "an integer"),
                       ("float", "a finite number")):
        if part in annotation:
            return kind
    return "a string"


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line if len(line) <= 120 else line[:117] + "..."


@contextlib.contextmanager
def gguf_file(out: Path, arch: str):
    """A ``GGUFWriter`` for ``out``: the file is written beside it and moved into place
    once the block has added everything (nothing is left behind when it raises)."""
    tmp = fsio.tmp_sibling(out)  # a killed export's is removed by the next one
    writer = _gguf().GGUFWriter(str(tmp), arch)
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def export_gguf_from(source: str | Path, out: str | Path, dtype: str = "f16",
                     tokenizer_dir: Optional[str | Path] = None) -> Path:
    """``lmforge export SOURCE OUT --format gguf``: SOURCE is a Hugging Face model
    directory, or a checkpoint / run directory, exported to HF first (LoRA merged in)
    in a temporary directory beside OUT."""
    source, out = Path(source), Path(out)
    fsio.check_writable(out, "OUT")
    if dtype not in GGUF_DTYPES:  # before a checkpoint is read
        raise GGUFError(f"--gguf-dtype: {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    if (source / "config.json").is_file():
        return export_gguf(source, out, dtype)
    path = find_checkpoint(source)
    # from the checkpoint's index: the tensors are read once, by the HF export
    lora = any(is_lora_param(k) for k in model_tensor_metadata(path))
    with fsio.temporary_dir(out) as tmp, \
            naming(Path(tmp) / run_name(path), path):
        # named after the run: llama.cpp's general.name is read off the directory's name
        hf = export_checkpoint(path, Path(tmp) / run_name(path), "merged" if lora else "hf",
                               tokenizer_dir)
        return export_gguf(hf, out, dtype)


def export_gguf_merged(model_dir: str | Path, adapter_dir: str | Path, out: str | Path,
                       dtype: str = "f16") -> Path:
    """``lmforge lora merge --format gguf``: the PEFT adapter ``adapter_dir`` merged into
    the Hugging Face model ``model_dir``, as one GGUF file (the merged model is written
    to a temporary directory beside ``out`` first)."""
    model_dir, out = Path(model_dir), Path(out)
    fsio.check_writable(out, "--output")
    if dtype not in GGUF_DTYPES:
        raise GGUFError(f"--gguf-dtype: {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    _gguf()
    gguf_family(model_dir)  # refused before the weights are read
    pre_tokenizer(model_dir)
    model = load_hf_model(model_dir)
    load_adapter(model, adapter_dir)
    with fsio.temporary_dir(out) as tmp, \
            naming(Path(tmp) / out.stem, model_dir):
        # named as the output file: llama.cpp's general.name is read off the directory's
        merged = export_merged(model, Path(tmp) / out.stem, tokenizer=load_tokenizer(model_dir))
        return export_gguf(merged, out, dtype)


def export_gguf_lora_from(source: str | Path, out: str | Path, base: Optional[str | Path],
                          dtype: str = "f32") -> Path:
    """``lmforge export SOURCE OUT --format gguf-lora``: SOURCE is a PEFT adapter
    directory, or a LoRA checkpoint / run directory (its adapter exported first); the
    base model directory is ``base``, else the adapter's ``base_model_name_or_path``."""
    source, out = Path(source), Path(out)
    fsio.check_writable(out, "OUT")
    if (source / "adapter_config.json").is_file():
        return export_gguf_lora(source, _base_dir(source, base), out, dtype)
    path = find_checkpoint(source)
    with fsio.temporary_dir(out) as tmp, \
            naming(Path(tmp) / "adapter", path):
        adapter = export_checkpoint(path, Path(tmp) / "adapter", "peft")
        return export_gguf_lora(adapter, _base_dir(adapter, base), out, dtype)


def _base_dir(adapter: Path, base: Optional[str | Path]) -> Path:
    if base is None:
        raw = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
        base = raw.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise GGUFError(f"--base: the base model directory of {adapter} (config.json, "
                        f"weights): give --base DIR (the adapter names {base!r})")
    return Path(base)


def export_gguf_lora(adapter_dir: str | Path, base_dir: str | Path, out: str | Path,
                     dtype: str = "f32") -> Path:
    """A PEFT adapter as the LoRA GGUF llama.cpp loads beside its base's GGUF
    (``--lora``): each adapted weight's A and B under the base tensor's name plus
    ``.lora_a`` / ``.lora_b``. Each module's scaling (alpha / r, or / sqrt(r) for rsLoRA,
    per-module patterns included) is folded into B, and the file's alpha is 0, which
    llama.cpp reads as a scale of 1."""
    gguf = _gguf()
    adapter_dir, base_dir, out = Path(adapter_dir), Path(base_dir), Path(out)
    if dtype not in ("f32", "f16"):
        raise GGUFError(f"--gguf-dtype: a LoRA GGUF holds f32 or f16, not {dtype!r}")
    args, family = gguf_family(base_dir)
    pairs, config = checked_adapter(adapter_dir, args)
    arch = family.gguf.architecture(args)
    name_map = gguf.get_tensor_name_map(_arch_enum(gguf, arch), args.n_layers)
    with gguf_file(out, arch) as writer:
        writer.add_type("adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", 0.0)
        for module, (a, b) in pairs.items():
            hf_name = f"{module}.weight"
            scaling = config.alpha(module) / (math.sqrt(config.rank(module))
                                              if config.use_rslora else config.rank(module))
            name = family.gguf.gguf_name(hf_name, name_map)
            b = family.gguf.rows_as_gguf(hf_name, b.float() * scaling, args)
            _add_tensor(gguf, writer, f"{name}.lora_a", a.float().contiguous(), dtype)
            _add_tensor(gguf, writer, f"{name}.lora_b", b.contiguous(), dtype)
    return out


def checked_adapter(adapter_dir: Path, args):
    """(HF module name -> (A, B), the adapter's config) of a PEFT adapter, checked
    against the base model's shape as lora merge checks it (adapter_config.json, target
    modules and layers the base has, each A and B's shape and rank, no NaN or Inf)."""
    config, weights = read_adapter_config(adapter_dir)
    linears = adapter_linears(args)
    check_against_base(config, linears, args.n_layers)
    pairs = adapter_pairs(config, weights, linears, Path(adapter_dir) / ADAPTER_WEIGHTS)
    return pairs, config


def run_name(checkpoint: Path) -> str:
    """The name of the run a checkpoints/step-NNNNNNN directory belongs to (else the
    checkpoint's own)."""
    checkpoint = Path(checkpoint).resolve()
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent.name
    return checkpoint.name


def gguf_family(model_dir: Path):
    """(args, family) of the model in ``model_dir``, refused (before anything is written)
    when its family has no GGUF form."""
    args = read_model_args(model_dir)
    family = family_of(args)
    if isinstance(family.gguf, str):
        raise GGUFError(f"{model_dir}: no GGUF export of the {family.name} family "
                        f"(model_type {args.family!r}): {family.gguf}; export to HF instead")
    why = getattr(family.gguf, "unsupported", lambda _: "")(args)
    if why:
        raise GGUFError(f"{model_dir}: no GGUF export of this model: {why}; export to HF "
                        f"instead")
    _arch_enum(_gguf(), family.gguf.architecture(args))  # (refused before anything is read)
    return args, family


def _arch_enum(gguf, arch: str):
    """The gguf package's member for llama.cpp's architecture ``arch``, refused in one
    line where the installed package is older than the architecture."""
    for member, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return member
    raise GGUFError(f"--format gguf: the installed gguf package ({_version('gguf')}) does "
                    f"not know llama.cpp's {arch} architecture, which this model needs; "
                    f"upgrade it (pip install -U gguf)")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "version unknown"


def _file_type(gguf, dtype: str) -> int:
    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]


# Matrices llama.cpp's converter keeps in f32 whatever the file type: an MoE router's
# (which picks the experts: rounding it would change the choice)
# MoE routers; and a Gated DeltaNet's convolution kernel, which ggml's ssm_conv reads
# in f32 only (llama.cpp 0.3.36 aborts on an f16 one; its converter keeps it f32)
F32_MATRICES = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")


def _add_tensor(gguf, writer, name: str, tensor: torch.Tensor, dtype: str) -> None:
    """Matrices in ``dtype``; vectors (norms, biases, rope factors), MoE routers and any
    tensor that is not a weight (gpt-oss's per-expert biases) in f32, as llama.cpp's
    converter keeps them."""
    data = tensor.detach().float().cpu().numpy()
    if data.ndim < 2 or dtype == "f32" or kept_f32(name):
        writer.add_tensor(name, data.astype(np.float32))
    elif dtype == "f16":
        writer.add_tensor(name, data.astype(np.float16))
    elif dtype == "bf16":
        bits = tensor.detach().to(torch.bfloat16).cpu().view(torch.int16).numpy()
        writer.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    elif not q8_0_fits(data.shape):  # rows not in whole blocks: f16, as llama.cpp's converter
        writer.add_tensor(name, data.astype(np.float16))
    else:  # (the writer reads the element shape back from the packed bytes' shape)
        packed = gguf.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def kept_f32(gguf_name: str) -> bool:
    """Whether a matrix is stored in f32 whatever the file type (``F32_MATRICES``, and
    what is neither a weight nor a LoRA adapter's A or B)."""
    return (gguf_name.endswith(F32_MATRICES)
            or not gguf_name.endswith((".weight", ".lora_a", ".lora_b")))


def q8_0_fits(shape) -> bool:
    """Whether a matrix's rows split into q8_0's blocks (of 32 values); one that does not
    is stored in f16."""
    return shape[-1] % _gguf().GGML_QUANT_SIZES[_gguf().GGMLQuantizationType.Q8_0][0] == 0
