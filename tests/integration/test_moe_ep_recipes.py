"""The expert-parallel MoE recipes (configs/qwen3-235b-a22b-ep.yaml on 4 nodes x 8 GPUs,
configs/deepseek-v3-ep.yaml on 16 x 8; docs/moe.md, "Layouts"): on a model directory of
the real shape (its config.json and a chat tokenizer; a dry run reads no weights) each
passes `lmforge train --dry-run` for the processes its header launches, `lmforge
estimate` puts it under an 80 GB GPU, `lmforge launch slurm` writes its batch script for
the header's nodes (and refuses fewer), and its layout is the one `lmforge plan`
proposes first."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers.real_tokenizers import save_tokenizer
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.models.registry import PRESETS, family_of
from lmforge.perf.estimate import GiB, estimate_memory
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.perf.layout_search import plan
from lmforge.perf.timing import DEVICES

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPUS_PER_NODE = 8
# recipe -> (the preset of its model's shape, the nodes its header launches on)
RECIPES = {"qwen3-235b-a22b-ep.yaml": ("qwen3-235b-a22b", 4),
           "deepseek-v3-ep.yaml": ("deepseek-v3", 16)}
LAYOUT_KEYS = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.ep", "parallel.tp",
               "parallel.pp", "parallel.cp", "parallel.zero", "data.micro_batch_size",
               "train.activation_checkpointing", "train.loss_chunk_tokens")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """A Hugging Face directory per recipe: config.json of the real model, a ChatML
    tokenizer, no weights."""
    root = tmp_path_factory.mktemp("ep-recipes")
    out = {}
    for name, (preset, _) in RECIPES.items():
        model = root / preset
        model.mkdir()
        save_tokenizer("chatml", model)
        args = PRESETS[preset]
        (model / "config.json").write_text(json.dumps(family_of(args).hf_config(args)))
        out[name] = model
    return out


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ep-data") / "chat.jsonl"
    row = {"messages": [{"role": "user", "content": "What is 3 + 4?"},
                        {"role": "assistant", "content": "7"}]}
    path.write_text(json.dumps(row) + "\n")
    return path


def _inputs(name: str, model_dirs, chat) -> list[str]:
    return [f"model.init_from={model_dirs[name]}", f"data.path={chat}"]


def _header_nodes(name: str) -> int:
    header = "".join(line for line in (CONFIGS / name).read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    found = re.search(r"--nodes (\d+) --gpus-per-node (\d+)", header)
    assert found and int(found.group(2)) == GPUS_PER_NODE, header
    return int(found.group(1))


def _preset_config(name: str):
    """The recipe with the model's shape from its preset (the real vocabulary)."""
    preset, _ = RECIPES[name]
    return load_config(CONFIGS / name, ["model.init_from=null", f"model.preset={preset}",
                                        f"model.vocab_size={PRESETS[preset].vocab_size}"])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_an_ep_recipe_passes_a_dry_run_for_the_processes_its_header_launches(
        name, model_dirs, chat, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    nodes = RECIPES[name][1]
    assert _header_nodes(name) == nodes
    out = tmp_path / "run"
    # (train.device=cuda: the estimate of the GPU run; no GPU here, so it is not checked
    # against this host's memory)
    code = main(["train", str(CONFIGS / name), *_inputs(name, model_dirs, chat),
                 f"train.output_dir={out}", "train.device=cuda", "--dry-run",
                 "--world-size", str(nodes * GPUS_PER_NODE)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "dry run: the config is valid" in printed
    layout = next(s for s in printed.splitlines() if s.startswith("layout:"))
    assert re.search(r"; ep 8: \d+ experts per layer on each rank, FSDP-sharded over \d",
                     layout), layout
    assert "experts.gate_up_proj,experts.down_proj" in printed  # LoRA on the experts
    assert not out.exists()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_an_ep_recipe_fits_an_80_gb_gpu_by_the_estimate(name, model_dirs, chat, capsys):
    nodes = RECIPES[name][1]
    setup = setup_from_config(_preset_config(name), device="cuda",
                              world_size=nodes * GPUS_PER_NODE)
    assert setup.ep == 8 and setup.experts_in_fsdp and setup.lora is not None
    assert estimate_memory(setup).total_bytes < 80 * GiB
    code = main(["estimate", str(CONFIGS / name), *_inputs(name, model_dirs, chat),
                 "--device", "cuda", "--world-size", str(nodes * GPUS_PER_NODE), "--json"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads(printed)
    assert data["setup"]["ep"] == 8
    assert data["total_gib"] == pytest.approx(estimate_memory(setup).total_bytes / GiB,
                                              rel=1e-6)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_launch_slurm_writes_an_ep_recipes_script_for_its_nodes(name, model_dirs, chat,
                                                                tmp_path, capsys):
    nodes = RECIPES[name][1]
    script = tmp_path / "job.sbatch"
    argv = ["launch", "slurm", str(CONFIGS / name), *_inputs(name, model_dirs, chat),
            "--gpus-per-node", str(GPUS_PER_NODE), "--env", "none"]
    assert main([*argv, "--nodes", str(nodes), "--output", str(script)]) == 0
    text = script.read_text()
    assert f"{nodes} node(s) x {GPUS_PER_NODE} process(es)" in text
    assert f"#SBATCH --nodes={nodes}" in text and str(CONFIGS / name) in text
    capsys.readouterr()
    fewer = tmp_path / "fewer.sbatch"
    assert main([*argv, "--nodes", str(nodes // 2), "--output", str(fewer)]) == 2
    assert "must equal the world size" in capsys.readouterr().err
    assert not fewer.exists()


@pytest.mark.slow
@pytest.mark.long  # (make test-long: about 16 s / 11 s on 2 cores)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_an_ep_recipes_layout_is_the_one_plan_proposes_first(name):
    """`lmforge plan` on the header's GPUs (80 GB H100s) ranks the recipe's layout first."""
    nodes = RECIPES[name][1]
    cfg = _preset_config(name)
    result = plan(cfg, nodes * GPUS_PER_NODE, GPUS_PER_NODE, DEVICES["h100"])
    best = result.candidates[0]
    recipe = setup_from_config(cfg, device="cuda", world_size=nodes * GPUS_PER_NODE)
    for key in LAYOUT_KEYS:
        section, field = key.split(".")
        ours = getattr(getattr(recipe.cfg, section), field)
        assert best.keys.get(key, ours) == ours, (key, best.describe())
