"""The GRPO recipes (configs/llama3-8b-grpo-lora.yaml on one GPU, llama3-8b-grpo-fsdp2.yaml
on 8 with FSDP2) pass ``lmforge train --dry-run`` on a Llama-3-8B-shaped model directory
(its config.json and a Llama 3 tokenizer; a dry run reads no weights) for the processes
their headers launch: the config is valid, the estimate prints the rollout their headers
describe and fits an 80 GB GPU, and nothing is written."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers.real_tokenizers import save_tokenizer
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.perf.estimate import GiB, estimate_memory
from lmforge.perf.estimate_setup import setup_from_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# recipe -> (the processes its header launches, the rollout its header describes: rows
# per GPU, as 2 prompts x 8 completions, over as many positions)
RECIPES = {"llama3-8b-grpo-lora.yaml": (1, "16 rows (2 prompts x rl.num_generations 8) x 1024 "),
           "llama3-8b-grpo-fsdp2.yaml": (8, "16 rows (2 prompts x rl.num_generations 8) x 1536 ")}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("grpo-recipes")
    model = root / "llama3-8b"
    model.mkdir()
    save_tokenizer("llama3", model)
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    data = root / "math.jsonl"
    data.write_text(json.dumps({"prompt": "What is 3 + 4?", "answer": "7"}) + "\n")
    return [f"model.init_from={model}", f"data.path={data}"]


def _header_processes(name: str) -> int:
    header = "".join(line for line in (CONFIGS / name).read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    found = re.search(r"torchrun --nproc-per-node (\d+) -m lmforge\.cli train configs/" +
                      re.escape(name), header)
    return int(found.group(1)) if found else 1


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_grpo_recipe_passes_a_dry_run_for_the_processes_its_header_launches(
        name, inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    processes, rollout = RECIPES[name]
    assert _header_processes(name) == processes
    out = tmp_path / "run"
    # (train.device=cuda: the estimate of the GPU run; no GPU here, so it is not checked
    # against this host's memory)
    code = main(["train", str(CONFIGS / name), *inputs, f"train.output_dir={out}",
                 "train.device=cuda", "--dry-run", "--world-size", str(processes)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "dry run: the config is valid" in printed
    line = next(s for s in printed.splitlines() if s.startswith("rollout:"))
    assert line.startswith(f"rollout: {rollout}positions"), line
    assert not out.exists()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_grpo_recipe_fits_an_80_gb_gpu_by_the_estimate(name):
    processes, _ = RECIPES[name]
    cfg = load_config(CONFIGS / name, ["model.init_from=null", "model.preset=llama3-8b",
                                       "model.vocab_size=128256", "data.path=math.jsonl"])
    setup = setup_from_config(cfg, device="cuda", world_size=processes)
    assert setup.job.objective == "grpo" and setup.layout.dp_shard == processes
    assert setup.reference == ("pass" if cfg.lora.enabled else "copy")
    assert estimate_memory(setup).total_bytes < 80 * GiB
