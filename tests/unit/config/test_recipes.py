"""Every recipe under configs/ does what its header says: the command line written there
loads and validates, and the numbers its comments promise follow from its settings."""
import re
from pathlib import Path

import pytest

from lmforge.config import load_config, resolve_layout
from lmforge.models.llama import build_llama
from lmforge.models.presets import PRESETS, validate_job
from lmforge.peft.lora import apply_lora, is_lora_param
from lmforge.perf.estimate_setup import setup_from_config

CONFIGS_DIR = Path(__file__).resolve().parents[3] / "configs"
CONFIGS = sorted(CONFIGS_DIR.glob("*.yaml"))
OVERRIDE = re.compile(r"(?<![\w.-])([a-z_]+\.[a-z_]+)=(\S+)")


def _header_command(path: Path) -> tuple[int, list[tuple[str, str]]]:
    """(processes, [(key, value)]) of the `lmforge train` / torchrun / `lmforge launch
    slurm` line of the header (SLURM's: --nodes x --gpus-per-node processes)."""
    header = "".join(line[1:] for line in path.read_text().splitlines(keepends=True)
                     if line.startswith("#"))
    command = re.search(r"(?:torchrun[^\n]*|lmforge) (?:train|launch slurm) configs/\S+"
                        r"(?:[^\n]*\\\n)*[^\n]*", header)
    if command is None:
        return 1, []
    text = command.group(0)
    nproc = re.search(r"--nproc-per-node[ =](\d+)", text)
    nodes, gpus = (re.search(rf"--{flag}[ =](\d+)", text)
                   for flag in ("nodes", "gpus-per-node"))
    processes = (int(nproc.group(1)) if nproc else
                 int(nodes.group(1)) * int(gpus.group(1)) if nodes and gpus else 1)
    return processes, OVERRIDE.findall(text)


def _required_keys(path: Path) -> list[str]:
    """``section.key`` of each field the recipe leaves null and marks ``(required)``."""
    keys, section = [], None
    for line in path.read_text().splitlines():
        if re.match(r"[a-z_]+:", line):
            section = line.split(":")[0]
        found = re.match(r"\s+([a-z_]+):\s*null\s*#.*\(required\)", line)
        if found:
            keys.append(f"{section}.{found.group(1)}")
    return keys


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_recipe_header_command_sets_its_keys_and_validates(path, tmp_path):
    processes, overrides = _header_command(path)
    assert set(_required_keys(path)) <= {k for k, _ in overrides}, "fill the required fields"
    cfg = load_config(path, [f"{k}={v}" for k, v in overrides])
    for key, value in overrides:  # each key of the documented command exists and lands
        section, name = key.split(".")
        assert str(getattr(getattr(cfg, section), name)) == value, key
    if cfg.data.kind in ("pretrain", "sft", "text", "preference") and not cfg.data.path:
        cfg.data.path = str(tmp_path / "data")
    if cfg.model.init_from is not None:  # shapes come from config.json at run time
        cfg.model.init_from, cfg.model.preset = str(tmp_path), "llama2-7b"
    validate_job(cfg, world_size=processes)


def test_the_documented_recipes_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny-cpu.yaml", "llama2-7b-lora.yaml", "llama2-7b-qlora.yaml",
            "llama2-7b-cpt.yaml", "tiny-dialogsum-base.yaml",
            "tiny-dialogsum-lora.yaml", "llama3-8b-dpo-lora.yaml",
            "llama3-8b-dpo-8gpu.yaml"} <= names


@pytest.mark.parametrize("name,reference", [("llama3-8b-dpo-lora.yaml", "pass"),
                                            ("llama3-8b-dpo-8gpu.yaml", "")])
def test_dpo_recipes_estimate_their_reference_as_their_headers_say(name, reference):
    """The LoRA recipe's reference is its adapters-off pass (no copy); the 8-GPU one's is
    precomputed (nothing during the run)."""
    cfg = load_config(CONFIGS_DIR / name, ["model.init_from=null", "model.preset=llama3-8b",
                                            "model.vocab_size=128256", "data.path=pairs.jsonl"])
    setup = setup_from_config(cfg, device="cuda", world_size=8 if "8gpu" in name else 1)
    assert setup.reference == reference and setup.job.objective == "dpo"
    assert setup.micro_batch == 2 * cfg.data.micro_batch_size  # two sequences per pair


def test_tiny_cpu_recipe_is_the_embedded_demo():
    assert load_config(CONFIGS_DIR / "tiny-cpu.yaml").to_dict() == load_config(None).to_dict()


def test_cpt_recipe_steps_a_million_tokens_sharded_over_every_gpu():
    cfg = load_config(CONFIGS_DIR / "llama2-7b-cpt.yaml")
    assert cfg.data.seq_len * cfg.data.global_batch_size == 1 << 20
    assert cfg.parallel.zero == 3
    for gpus in (8, 16):  # dp_shard=-1: FSDP2 over however many GPUs the job has
        layout = resolve_layout(cfg.parallel, gpus)
        assert layout["dp_replicate"] * layout["dp_shard"] == gpus


@pytest.mark.parametrize("name, adapter_millions", [("llama2-7b-lora.yaml", 40),
                                                     ("llama2-7b-qlora.yaml", 160)])
def test_7b_lora_recipes_train_only_adapters_of_the_promised_size(name, adapter_millions):
    cfg = load_config(CONFIGS_DIR / name)
    model = build_llama(PRESETS["llama2-7b"])  # meta device: no memory touched
    swapped = apply_lora(model, cfg.lora)
    seven = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {n.rsplit(".", 1)[-1] for n in swapped} == seven
    assert len(swapped) == len(seven) * PRESETS["llama2-7b"].n_layers
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_lora_param(n))
    assert round(adapters / 1e6) == adapter_millions
    assert cfg.lora.enabled and (cfg.lora.quantize == "nf4") == ("qlora" in name)


def test_the_64k_recipe_splits_each_sequence_over_cp_and_steps_a_million_tokens():
    cfg = load_config(CONFIGS_DIR / "llama3.1-8b-cpt-64k.yaml")
    assert cfg.data.seq_len * cfg.data.global_batch_size == 1 << 20
    layout = resolve_layout(cfg.parallel, 8)
    assert (layout["cp"], layout["dp_shard"]) == (4, 2)
    assert cfg.data.seq_len // layout["cp"] == 16384  # tokens of each sequence per GPU
    assert cfg.data.seq_len <= PRESETS["llama3.1-8b"].max_seq_len  # no extension needed
