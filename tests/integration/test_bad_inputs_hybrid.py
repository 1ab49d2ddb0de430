"""Bad-input table of the hybrid linear-attention families (issue 47): Qwen3.5's language
model (a ``Qwen3_5ForCausalLM`` directory and the Hub's ``Qwen3_5ForConditionalGeneration``
one), Qwen3-Next and Qwen3.5-MoE, each a tiny transformers-made directory (three Gated
DeltaNet layers, then a full-attention one). A ``layer_types`` of another length than the
layers or with another kind of layer, a head split the linear layers cannot take (value
heads not a whole group per key head, which the convolution's channels are laid out by; a
key head width or kernel other than the checkpoint's convolution has), a rotary share RoPE
cannot take, and a checkpoint missing one linear layer's state weights (A_log, dt_bias,
conv1d.weight; Qwen3-Next's fused projection): each refused by train, estimate, generate
or a GGUF export in one line naming the config.json field or the file's tensor, with the
row's directory (the model directory among it) left as it was. The harness:
tests/helpers/bad_inputs.py."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from helpers.bad_inputs import Bad, check_refused, params
from helpers.hf_models import random_hf_causal_lm
from lmforge.data.tokenizer import load_tokenizer

LINEAR = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, head_dim=16,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_conv_kernel_dim=4)
EXPERTS = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
               num_experts_per_tok=2)
MODEL_TYPES = {"qwen3_5": ("qwen3_5_text", {}), "qwen3_next": ("qwen3_next", EXPERTS),
               "qwen3_5_moe": ("qwen3_5_moe_text", EXPERTS)}
FAMILIES = (*MODEL_TYPES, "image_text")  # image_text: a Qwen3_5ForConditionalGeneration
PREFIX = {"image_text": "model.language_model."}  # (else model.)

TRAIN = ["train", "model.init_from={tmp}/m", "train.output_dir={tmp}/run", "train.device=cpu",
         "data.kind=text", "data.path={text}", "data.seq_len=64", "data.micro_batch_size=1",
         "data.global_batch_size=1", "train.max_steps=1", "optim.warmup_steps=0",
         "train.skip_memory_check=true"]  # (the memory check traces a step: not the rows')
ESTIMATE = ["estimate", "model.init_from={tmp}/m"]
GENERATE = ["generate", "--model", "{tmp}/m", "--prompt", "hi", "--max-new-tokens", "2"]
GGUF = ["export", "{tmp}/m", "{tmp}/m.gguf", "--format", "gguf"]
COMMANDS = {"train": TRAIN, "estimate": ESTIMATE, "generate": GENERATE, "gguf": GGUF}
CONFIG = r"^{tmp}/m/config\.json: "  # (an image-text one's fields: "text_config: " next)
WEIGHTS = {"train": r"^{tmp}/m weights: ", "generate": r"^{tmp}/m/model\.safetensors: ",
           "gguf": r"^{tmp}/m/model\.safetensors: "}


@pytest.fixture(scope="module")
def hybrid_assets(bad_input_assets, tmp_path_factory) -> dict:
    """The shared assets and, once, a tiny model directory of each hybrid family (the
    shared tokenizer beside it, the vocabulary its size) for the rows to copy."""
    import transformers

    transformers.logging.set_verbosity_error()  # (its warnings and bars: not the rows')
    root = tmp_path_factory.mktemp("hybrid")
    vocab = load_tokenizer(bad_input_assets["tokenizer"]).vocab_size
    dirs = {}
    with contextlib.redirect_stderr(io.StringIO()):
        for family, (model_type, extra) in MODEL_TYPES.items():
            random_hf_causal_lm(model_type, **LINEAR, **extra,
                                vocab_size=vocab).save_pretrained(root / family)
            dirs[family] = root / family
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=64, patch_size=4, temporal_patch_size=2,
                      spatial_merge_size=2, num_position_embeddings=16)
        config = transformers.Qwen3_5Config(text_config=dict(LINEAR, vocab_size=vocab),
                                            vision_config=vision)
        transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(
            root / "image_text")
        dirs["image_text"] = root / "image_text"
    for path in dirs.values():
        shutil.copytree(bad_input_assets["tokenizer"], path, dirs_exist_ok=True)
    return {**bad_input_assets, **dirs}


def model(family: str, edit=None):
    """A setup: ``family``'s directory copied to {tmp}/m, then ``edit(that path)``."""
    def setup(tmp: Path, assets: dict) -> None:
        shutil.copytree(assets[family], tmp / "m")
        if edit is not None:
            edit(tmp / "m")
    return setup


def text_config(**changes):
    """An edit: config.json's language-model fields changed (an image-text model's
    ``text_config``)."""
    def edit(path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        (cfg["text_config"] if "text_config" in cfg else cfg).update(changes)
        (path / "config.json").write_text(json.dumps(cfg))
    return edit


def without(name: str):
    """An edit: tensor ``name`` taken out of model.safetensors."""
    def edit(path: Path) -> None:
        tensors = load_file(path / "model.safetensors")
        del tensors[name]
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return edit


def rope(partial: float) -> dict:
    """rope_parameters with another rotary share (transformers 5 writes it there)."""
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": partial}}


def field(family: str, message: str) -> str:
    """The message of a refused config.json field of ``family``'s directory."""
    return CONFIG + ("text_config: " if family == "image_text" else "") + message


def rows(name: str, runs: dict, edit, message) -> list[Bad]:
    """One row per (family, command) in ``runs``; ``message(family, command)``."""
    return [Bad(f"{name} ({family}, {command})", COMMANDS[command], message(family, command),
                setup=model(family, edit))
            for family, commands in runs.items() for command in commands]


EVERY_COMMAND = {family: ("train", "estimate", "generate") for family in FAMILIES}
LAYER_COUNT = rows(
    "a layer_types of 3 entries for 4 layers", EVERY_COMMAND,
    text_config(layer_types=["linear_attention"] * 3),
    lambda family, _: field(family, r"layer_types: 3 entries for num_hidden_layers = 4; "
                                    r"one per layer$"))
LAYER_KIND = [
    *rows("a layer_types entry of another kind",
          {"qwen3_5": ("train",), "qwen3_next": ("generate",), "qwen3_5_moe": ("estimate",),
           "image_text": ("train",)},
          text_config(layer_types=["linear_attention", "sliding_attention",
                                   "linear_attention", "full_attention"]),
          lambda family, _: field(family, r"layer_types: 'sliding_attention' is not one of "
                                          r"linear_attention, full_attention \(entry 1\)$")),
    Bad("a layer_types that is no list", GENERATE,
        field("qwen3_5", r"layer_types: 'linear_attention' is not a list \(one entry per "
                         r"layer\)$"),
        setup=model("qwen3_5", text_config(layer_types="linear_attention"))),
]
HEADS = [
    # 3 value heads for 2 key heads: the convolution's channels are per key head, its q,
    # its k and the v of a whole group of value heads
    *rows("value heads not a whole group per key head",
          {family: ("train", "generate") for family in FAMILIES},
          text_config(linear_num_value_heads=3),
          lambda family, _: field(family, r"linear_num_value_heads: 3 is not a multiple of "
                                          r"linear_num_key_heads \(2\)$")),
    *rows("key heads that do not divide the value heads",
          {"qwen3_5": ("estimate",), "qwen3_next": ("train",)},
          text_config(linear_num_key_heads=3),
          lambda family, _: field(family, r"linear_num_value_heads: 4 is not a multiple of "
                                          r"linear_num_key_heads \(3\)$")),
    *rows("a key head width other than the checkpoint's convolution",
          {"qwen3_5": ("generate",), "qwen3_5_moe": ("train",)},
          text_config(linear_key_head_dim=12),
          lambda family, command: WEIGHTS[command] + r"misshaped: .*model\.layers\.0\."
          r"linear_attn\.conv1d\.weight \(64, 1, 4\) \(expected \(80, 1, 4\)\)"),
    *rows("a kernel other than the checkpoint's convolution",
          {"qwen3_5": ("train",), "image_text": ("generate",)},
          text_config(linear_conv_kernel_dim=2),
          lambda family, command: WEIGHTS[command] + r"misshaped: " + PREFIX.get(
              family, "model.").replace(".", r"\.") + r"layers\.0\.linear_attn\.conv1d\."
          r"weight \(64, 1, 4\) \(expected \(64, 1, 2\)\)"),
    Bad("a kernel of no taps", TRAIN,
        field("qwen3_next", r"linear_conv_kernel_dim: 0 is not a positive integer$"),
        setup=model("qwen3_next", text_config(linear_conv_kernel_dim=0))),
    *(Bad(f"a rotary share of {partial} ({family})", command, field(
          family, rf"partial_rotary_factor: {partial} of head_dim 16 rotates {turning} "
                  rf"features; RoPE needs an even number, at least 2, at most head_dim$"),
          setup=model(family, text_config(**rope(partial))))
      for partial, turning, family, command in ((0.1, "1.6", "qwen3_5", GENERATE),
                                                (2.0, "32", "qwen3_next", TRAIN),
                                                (0.1, "1.6", "image_text", ESTIMATE))),
]


def missing(family: str, leaf: str, commands, marks=()) -> list[Bad]:
    """Rows of ``family``'s checkpoint without layer 2's (a linear one's) ``leaf``."""
    name = PREFIX.get(family, "model.") + f"layers.2.linear_attn.{leaf}"
    return [Bad(f"a checkpoint without {name} ({family}, {command})", COMMANDS[command],
                WEIGHTS[command] + "missing: " + name.replace(".", r"\.") + "$",
                setup=model(family, without(name)), marks=marks)
            for command in commands]


def long_unless(keep: bool) -> tuple:
    """A train row that loads weights costs 0.1-1 s: past one leaf per family (every
    leaf for Qwen3.5's text directory), make test-long's."""
    return () if keep else (pytest.mark.long,)


MISSING = [
    *(row for family in FAMILIES for leaf in ("A_log", "dt_bias", "conv1d.weight")
      for row in missing(family, leaf, ("train",),
                         long_unless(family == "qwen3_5" or leaf == "A_log"))),
    *(row for family in ("qwen3_5", "image_text")
      for leaf in ("A_log", "dt_bias", "conv1d.weight")
      for row in missing(family, leaf, ("gguf",))),
    *missing("qwen3_next", "A_log", ("gguf",)),  # (the MoE families' GGUF forms too)
    *missing("qwen3_5_moe", "conv1d.weight", ("gguf",)),
    *missing("qwen3_next", "A_log", ("generate",)),
    *missing("qwen3_5_moe", "dt_bias", ("generate",)),
    *missing("qwen3_next", "in_proj_qkvz.weight", ("train",)),  # (fused, checked first)
]
TABLE = [*LAYER_COUNT, *LAYER_KIND, *HEADS, *MISSING]


@pytest.mark.parametrize("row", params(TABLE))
def test_hybrid_input_is_refused_in_one_line(row, hybrid_assets, tmp_path, capsys):
    check_refused(row, hybrid_assets, tmp_path, capsys)
