"""A Hub Qwen3.5 checkpoint is an image-text model (``Qwen3_5ForConditionalGeneration``,
model_type ``qwen3_5``): its language model under ``model.language_model.``, the head
as ``lm_head``, a vision tower under ``model.visual.``, and a config.json whose
``text_config`` is the language model's. lmforge trains the language model; the vision
tower stays on disk, untouched, and an export writes it back tensor for tensor with the
original config (its ``text_config`` from the trained args), so the exported directory
is still the whole model transformers loads.

The args record the source directory (``HybridArgs.vision_from``): ``read_model_args``
passes it (``with_directory``); an export reads the vision tensors from it again."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from lmforge.models.mapping import HFCheckpointError, read_json

VISION_PREFIX = "model.visual."
LANGUAGE_PREFIX = "model.language_model."
ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
THIS_DIRECTORY = "<the model directory>"  # (until ``with_directory`` names it)


def text_config(cfg: dict, source: str) -> tuple[dict, bool]:
    """(the language model's config fields, whether ``cfg`` is an image-text model's)."""
    if not isinstance(cfg.get("text_config"), dict):
        return cfg, False
    if not isinstance(cfg.get("vision_config"), dict):
        raise HFCheckpointError(f"{source}: text_config without vision_config: not a "
                                f"{ARCHITECTURE} config")
    text = dict(cfg["text_config"])
    if "tie_word_embeddings" in cfg:  # (the whole model's: transformers ties by it, over
        # text_config's, measured: a top-level false with a text_config true is untied)
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    text.setdefault("tie_word_embeddings", False)
    return text, True


def with_directory(args, root) -> object:
    """``args`` read from ``root``: an image-text model's records where it is."""
    if args.vision_from != THIS_DIRECTORY:
        return args
    return dataclasses.replace(args, vision_from=str(Path(root).resolve()))


def hf_name(name: str, args) -> str:
    """Our HF name (``model.`` + the language model's) in the image-text layout."""
    if args.vision_from is None or not name.startswith("model."):
        return name
    return LANGUAGE_PREFIX + name.removeprefix("model.")


def drop_vision(sd: dict, args) -> dict:
    """The checkpoint's tensors without the vision tower's (kept on disk)."""
    if args.vision_from is None:
        return sd
    return {k: v for k, v in sd.items() if not k.startswith(VISION_PREFIX)}


def add_vision(hf_sd: dict, args) -> dict:
    """The exported tensors with the source's vision tower, read again, unchanged."""
    if args.vision_from is None:
        return hf_sd
    from lmforge.models.hf import read_hf_state_dict  # (models/hf.py imports the families)

    vision = {k: v for k, v in read_hf_state_dict(_source(args)).items()
              if k.startswith(VISION_PREFIX)}
    if not vision:
        raise HFCheckpointError(f"{args.vision_from}: no {VISION_PREFIX}* tensors to write "
                                f"back (the image-text model's vision tower)")
    return hf_sd | vision


def conditional_config(args, text: dict) -> dict:
    """The source's config.json with ``text`` (the trained args') as its text_config."""
    if args.vision_from is None:
        return text
    original = read_json(_source(args) / "config.json", "the image-text model's config")
    text_config = original.get("text_config", {})
    # (tying is the whole model's field: text_config's own, which transformers does not
    # read, stays as it was)
    tied = {"tie_word_embeddings": text["tie_word_embeddings"]}
    if "tie_word_embeddings" in text_config:
        text = {k: v for k, v in text.items() if k != "tie_word_embeddings"}
    kept = {k: v for k, v in text_config.items() if k not in text}
    return original | {"text_config": kept | text} | tied


def _source(args) -> Path:
    root = Path(args.vision_from)
    if args.vision_from == THIS_DIRECTORY or not root.is_dir():
        raise HFCheckpointError(f"model: the image-text model directory {args.vision_from} "
                                f"is not there to write its vision tower back from (an "
                                f"export needs it where it was loaded)")
    return root
