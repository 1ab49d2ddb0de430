"""Bad-input table of the mixture-of-experts families (issue 45): a config whose top-k
exceeds its experts, a checkpoint missing an expert, gpt-oss's MXFP4 blocks of another
shape than the config's, a router lmforge does not compute, and the expert-parallel
layouts not built (issue 46: parallel.ep on a dense model, not dividing the experts or
dp_shard, with pipeline or context parallelism), each refused in one line
naming the field or the file's tensor, with the row's directory left as it was. The
harness: tests/helpers/bad_inputs.py."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.bad_inputs import Bad, check_refused, params
from helpers.hf_models import random_hf_causal_lm

RUN = "train.output_dir={tmp}/run"
QWEN = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=16)


def moe_dir(model_type: str, edit=None, **config):
    """A setup: a tiny transformers-made ``model_type`` in {tmp}/m, then ``edit(dir)``."""
    def setup(tmp: Path, assets: dict) -> None:
        import transformers

        transformers.logging.set_verbosity_error()  # (its warnings and bars: not the row's)
        with contextlib.redirect_stderr(io.StringIO()):
            random_hf_causal_lm(model_type, **config).save_pretrained(tmp / "m")
        if edit is not None:
            edit(tmp / "m")
    return setup


def config_json(**changes):
    def edit(path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(cfg | changes))
    return edit


def without(name: str):
    def edit(path: Path) -> None:
        sd = load_file(path / "model.safetensors")
        del sd[name]
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return edit


def mxfp4_of_another_shape(path: Path) -> None:
    """gpt-oss's down_proj as MXFP4 blocks and scales for twice the experts' width."""
    sd = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    experts, ffn, dim = sd.pop(name).shape  # (experts, ffn, dim): blocks (E, dim, ffn/32, 16)
    sd[name + "_blocks"] = torch.zeros(experts, dim, 2 * ffn // 32, 16, dtype=torch.uint8)
    sd[name + "_scales"] = torch.full((experts, dim, 2 * ffn // 32), 127, dtype=torch.uint8)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(cfg))



def ep_row(name: str, world_size: int, fields: list[str], message: str,
           preset: str = "qwen3-moe-debug") -> Bad:
    """parallel.ep refused by a dry run for ``world_size`` processes (one process alone
    would be refused the layout's world size first)."""
    return Bad(name, ["train", "--dry-run", "--world-size", str(world_size), RUN,
                      f"model.preset={preset}", *fields], message)


TABLE = [
    ep_row("expert parallelism on a dense model", 2, ["parallel.dp_shard=2", "parallel.ep=2"],
           r"^parallel\.ep: 2 needs a mixture of experts; llama has none", preset="debug"),
    ep_row("an ep that does not divide the experts", 3, ["parallel.dp_shard=3",
           "parallel.ep=3"], r"^parallel\.ep: 3 does not divide the model's 16 experts"),
    ep_row("an ep that does not divide dp_shard", 2, ["parallel.dp_shard=2", "parallel.ep=4"],
           r"^parallel\.ep: 4 does not divide parallel\.dp_shard \(2\); the expert-parallel "
           r"ranks come out of the FSDP ranks$"),
    ep_row("an ep that does not divide dp_shard, though the experts", 6,
           ["parallel.dp_shard=6", "parallel.ep=4"],
           r"^parallel\.ep: 4 does not divide parallel\.dp_shard \(6\)"),
    *(ep_row(f"an ep with {key}", 4, ["parallel.dp_shard=2", "parallel.ep=2",
             f"parallel.{key}=2"], rf"^parallel\.ep: 2 with parallel\.{key}=2 is not "
             rf"supported \(a mixture of experts takes no pipeline or context parallelism")
      for key in ("pp", "cp")),
    Bad("a preset's top-k above its experts", ["train", "--dry-run", RUN,
        "model.preset=qwen3-moe-debug", "model.top_k=17"],
        r"^model\.top_k: 17 must be between 1 and the 16 experts"),
    Bad("a config.json whose top-k exceeds its experts",
        ["generate", "--model", "{tmp}/m", "--prompt", "hi", "--max-new-tokens", "2"],
        r"config\.json: num_experts_per_tok: 9 exceeds the 4 experts",
        setup=moe_dir("qwen3_moe", config_json(num_experts_per_tok=9), **QWEN)),
    Bad("a checkpoint missing an expert",
        ["generate", "--model", "{tmp}/m", "--prompt", "hi", "--max-new-tokens", "2"],
        r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight: missing",
        setup=moe_dir("qwen3_moe", without("model.layers.1.mlp.experts.3.up_proj.weight"),
                      **QWEN)),
    Bad("MXFP4 blocks of another shape than the config's",
        ["generate", "--model", "{tmp}/m", "--prompt", "hi", "--max-new-tokens", "2"],
        r"model\.layers\.0\.mlp\.experts\.down_proj",
        setup=moe_dir("gpt_oss", mxfp4_of_another_shape, num_local_experts=4,
                      num_experts_per_tok=2, head_dim=16, intermediate_size=64)),
    Bad("a router lmforge does not compute",
        ["generate", "--model", "{tmp}/m", "--prompt", "hi", "--max-new-tokens", "2"],
        r"config\.json: scoring_func",
        setup=moe_dir("deepseek_v3", config_json(scoring_func="softmax"), n_routed_experts=4,
                      num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=8,
                      q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=8, moe_intermediate_size=16, num_key_value_heads=4,
                      first_k_dense_replace=1)),
]


@pytest.mark.parametrize("row", params(TABLE))
def test_moe_input_is_refused_in_one_line(row, bad_input_assets, tmp_path, capsys):
    check_refused(row, bad_input_assets, tmp_path, capsys)
