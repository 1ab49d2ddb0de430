"""A Hugging Face model directory as one GGUF file, the format llama.cpp and Ollama run,
written with the ``gguf`` package (the GGUF library llama.cpp publishes; an optional
dependency, imported here only): ``export_gguf(model_dir, out, dtype)``.

What goes in:

* the family's architecture, shape keys and tensors (``models/<family>/gguf.py``; a
  family without one is refused before anything is written);
* the weights as ``f32``, ``f16``, ``bf16`` or ``q8_0`` (matrices; norms and other
  vectors stay f32, as llama.cpp's own converter keeps them, and a matrix whose rows are
  not whole q8_0 blocks of 32 is stored in f16);
* the tokenizer: a byte-level BPE vocabulary with its merges, token types (special
  added tokens are control tokens), the pre-tokenizer llama.cpp must apply, BOS and
  whether to add it, as the tokenizer's post-processor does;
* the chat template, and as EOS its end-of-turn token (``<|im_end|>``, ``<|eot_id|>``),
  so that llama.cpp and Ollama stop where the template stops.

The file is written beside its destination and moved into place once complete.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lmforge import fsio
from lmforge.checkpoint import find_checkpoint, model_tensor_metadata
from lmforge.config.errors import naming
from lmforge.data.templates import get_template
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.models.hf import load_hf_model, read_hf_state_dict, read_model_args
from lmforge.models.registry import family_of
from lmforge.peft.adapters import export_merged, load_adapter, read_adapter_config
from lmforge.peft.lora import is_lora_param
from lmforge.export import export_checkpoint

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")
# Pre-tokenizer regexes of tokenizer.json -> the name llama.cpp gives that pre-tokenizer
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
               r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}


class GGUFError(ValueError):
    """What a GGUF export cannot hold; the message names the model, field or dtype."""


def export_gguf(model_dir: str | Path, out: str | Path, dtype: str = "f16") -> Path:
    """``model_dir`` (config.json, safetensors, tokenizer.json) as the GGUF file ``out``."""
    gguf = _gguf()
    model_dir, out = Path(model_dir), Path(out)
    if dtype not in GGUF_DTYPES:
        raise GGUFError(f"--dtype: {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    args, family = gguf_family(model_dir)
    tokenizer = load_tokenizer(model_dir)
    pre = pre_tokenizer(model_dir)  # refuses a tokenizer llama.cpp would split otherwise
    arch = family.gguf.architecture(args)
    with gguf_file(out, arch) as writer:
        writer.add_name(model_dir.name)
        writer.add_file_type(_file_type(gguf, dtype))
        family.gguf.write_hparams(writer, args)
        write_tokenizer(writer, model_dir, tokenizer, args.vocab_size, pre)
        name_map = gguf.get_tensor_name_map(_arch_enum(gguf, arch), args.n_layers)
        for name, tensor in family.gguf.tensors(read_hf_state_dict(model_dir), args, name_map):
            _add_tensor(gguf, writer, name, tensor, dtype)
    return out


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
            naming(Path(tmp) / "hf", path):
        hf = export_checkpoint(path, Path(tmp) / "hf", "merged" if lora else "hf",
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
            naming(Path(tmp) / "hf", model_dir):
        merged = export_merged(model, Path(tmp) / "hf", tokenizer=load_tokenizer(model_dir))
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
    config, weights = read_adapter_config(adapter_dir)
    arch = family.gguf.architecture(args)
    name_map = gguf.get_tensor_name_map(_arch_enum(gguf, arch), args.n_layers)
    with gguf_file(out, arch) as writer:
        writer.add_type("adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", 0.0)
        for module, (a, b) in adapter_pairs(weights).items():
            hf_name = f"{module}.weight"
            scaling = config.alpha(module) / (math.sqrt(config.rank(module))
                                              if config.use_rslora else config.rank(module))
            name = family.gguf.gguf_name(hf_name, name_map)
            b = family.gguf.rows_as_gguf(hf_name, b.float() * scaling, args)
            _add_tensor(gguf, writer, f"{name}.lora_a", a.float().contiguous(), dtype)
            _add_tensor(gguf, writer, f"{name}.lora_b", b.contiguous(), dtype)
    return out


def adapter_pairs(weights: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (A, B) of a PEFT adapter's weights."""
    pairs: dict = {}
    for key, tensor in weights.items():
        module, _, which = key.removeprefix("base_model.model.").rpartition(".lora_")
        pairs.setdefault(module, {})[which.split(".")[0]] = tensor
    return {module: (p["A"], p["B"]) for module, p in pairs.items()}


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
    return args, family


def _gguf():
    try:
        import gguf  # optional: the GGUF writer llama.cpp publishes (pip install gguf)
    except ImportError:
        raise GGUFError("--format gguf: needs the gguf package (pip install gguf)") from None
    return gguf


def _arch_enum(gguf, arch: str):
    return next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


def _file_type(gguf, dtype: str) -> int:
    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]


def _add_tensor(gguf, writer, name: str, tensor: torch.Tensor, dtype: str) -> None:
    """Matrices in ``dtype``; vectors (norms, biases, rope factors) in f32."""
    data = tensor.detach().float().cpu().numpy()
    if data.ndim < 2 or dtype == "f32":
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


def q8_0_fits(shape) -> bool:
    """Whether a matrix's rows split into q8_0's blocks (of 32 values); one that does not
    is stored in f16."""
    return shape[-1] % _gguf().GGML_QUANT_SIZES[_gguf().GGMLQuantizationType.Q8_0][0] == 0


# ------------------------------------------------------------------------- tokenizer

def pre_tokenizer(model_dir: Path) -> str:
    """The name llama.cpp gives the tokenizer's pre-tokenizer; refused when the tokenizer
    is not byte-level BPE or splits by a rule llama.cpp does not know by name."""
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if spec.get("model", {}).get("type") != "BPE":
        raise GGUFError(f"{model_dir}/tokenizer.json: a {spec.get('model', {}).get('type')} "
                        f"tokenizer; the GGUF export writes byte-level BPE tokenizers only")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"]:
        name = PRE_TOKENIZERS.get(steps[0].get("pattern", {}).get("Regex"))
        if name is not None:
            return name
    steps_text = " + ".join(map(str, kinds))
    raise GGUFError(f"{model_dir}/tokenizer.json: a pre-tokenizer ({steps_text}) llama.cpp "
                    f"does not know by name; the GGUF export writes GPT-2, "
                    f"Llama 3 and Qwen2 byte-level BPE tokenizers")


def write_tokenizer(writer, model_dir: Path, tok: Tokenizer, n_vocab: int, pre: str) -> None:
    """Tokens (padded to the model's vocabulary), their types, merges, special ids and the
    chat template; EOS is the template's end-of-turn token where there is a template."""
    gguf = _gguf()
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for token, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        i = added["id"]
        tokens[i] = added["content"]
        types[i] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    before, after = tok.affixes
    if tok.bos_id is not None:
        writer.add_bos_token_id(tok.bos_id)
    writer.add_add_bos_token(bool(before) and before == [tok.bos_id])
    writer.add_add_eos_token(bool(after))
    eos = end_of_turn(tok)
    if eos is not None:
        writer.add_eos_token_id(eos)
    if tok.pad_id is not None:
        writer.add_pad_token_id(tok.pad_id)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def end_of_turn(tok: Tokenizer) -> Optional[int]:
    """The chat template's end-of-turn token, else the tokenizer's EOS."""
    if tok.chat_template:
        return get_template("auto", tok).end_of_turn_id(tok)
    return tok.eos_id
