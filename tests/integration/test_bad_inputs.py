"""A table of bad inputs across every command. Each row is refused in one line: exit
status 2, ``lmforge: error: `` and a message naming the field, the option or the file (and
line) at fault, no traceback, and nothing written: the row's directory, where every
output of the command line points, holds afterwards exactly what it held before.

The next hole found goes here as a row: a name, the command line, the message it must
print (a regular expression searched after "lmforge: error: "), and what to build first.
Command lines and paths may name ``{tmp}`` (the row's own empty directory) and the assets
built once for the whole table: ``{model}`` (a tiny transformers Llama with its
tokenizer), ``{adapter}`` (a PEFT adapter for it), ``{tokenizer}`` (the tokenizer alone),
``{text}`` (a small text corpus) and ``{chat}`` (prompt/response JSONL).
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

from lmforge import fsio
from lmforge.cli import main
from lmforge.config import LoraConfig
from lmforge.data.indexed import IndexedDatasetWriter
from lmforge.data.tokenizer import train_bpe
from lmforge.models.hf import load_hf_model, save_hf_model
from lmforge.peft import apply_lora, save_adapter

from helpers.tiny_models import tiny_llama


@dataclass(frozen=True)
class Bad:
    name: str
    argv: list[str]
    message: str  # a regular expression the one line must match after "lmforge: error: "
    setup: Optional[Callable[[Path, dict], None]] = None  # (row dir, assets) -> files
    marks: tuple = field(default=())


# ----------------------------------------------------------------- assets built once

@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("assets")
    lines = [f"line {i} of a small corpus about tensors and shards" for i in range(200)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    records = [{"prompt": f"Say hello {i}", "response": f"Hello {i}."} for i in range(40)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = train_bpe(lines + [json.dumps(r) for r in records], 300)
    tok.save(root / "tokenizer")
    save_hf_model(tiny_llama(vocab_size=tok.vocab_size), root / "model", tokenizer=tok)
    model = load_hf_model(root / "model")
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0,
                                 targets=["q_proj", "v_proj"]))
    save_adapter(model, root / "adapter", base_model_path=str(root / "model"))
    return {"model": root / "model", "adapter": root / "adapter",
            "tokenizer": root / "tokenizer", "text": root / "corpus.txt",
            "chat": root / "chat.jsonl"}


def copy_asset(name: str, to: str = None):
    """A setup that copies asset ``name`` into the row's directory (as ``to``), for rows
    that damage it; the row's argv then names ``{tmp}/<to>``."""
    def setup(tmp: Path, assets: dict) -> None:
        src = assets[name]
        dst = tmp / (to or name)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return setup


def edit_json(path: str, **changes):
    """A setup step that changes keys of a JSON file under the row's directory."""
    def setup(tmp: Path, assets: dict) -> None:
        file = tmp / path
        data = json.loads(file.read_text())
        data.update(changes)
        file.write_text(json.dumps(data))
    return setup


def write(path: str, content: str | bytes):
    def setup(tmp: Path, assets: dict) -> None:
        file = tmp / path
        file.parent.mkdir(parents=True, exist_ok=True)
        (file.write_bytes if isinstance(content, bytes) else file.write_text)(content)
    return setup


_HELD = []  # locks held for a row by "another job": this process, on its own open file


def hold_lock(path: str):
    """A setup that holds ``fsio.FileLock`` on a path under the row's directory until the
    test process ends, as a job still running would."""
    def setup(tmp: Path, assets: dict) -> None:
        lock = fsio.FileLock(tmp / path, remove=True)
        lock.acquire()
        _HELD.append(lock)
    return setup


def same_shape_pairs(tmp: Path, assets: dict) -> None:
    """Two indexed pairs a and b of equal sequence lengths, a's .bin replaced by b's (as
    two preprocess jobs racing on one prefix could leave it): the index checks pass."""
    for name, first in (("a", 1), ("b", 100)):
        with IndexedDatasetWriter(tmp / name, np.uint16) as w:
            w.add_document(np.arange(first, first + 40))
    (tmp / "b.bin").replace(tmp / "a.bin")


def edit_tensors(path: str, change):
    """A setup step that rewrites a safetensors file under the row's directory:
    ``change(tensors)`` edits the dict of tensors in place."""
    def setup(tmp: Path, assets: dict) -> None:
        from safetensors.torch import load_file, save_file
        tensors = load_file(tmp / path)
        change(tensors)
        save_file(tensors, str(tmp / path))
    return setup


def poison(name_part: str, value: float):
    """``change`` for ``edit_tensors``: the first tensor whose name holds ``name_part``
    gets ``value`` in one element."""
    def change(tensors: dict) -> None:
        name = next(k for k in sorted(tensors) if name_part in k)
        tensors[name].view(-1)[0] = value
    return change


def shard_index(target: str, link: Optional[str] = None):
    """A setup step that turns the row's model copy into a sharded one whose index names
    ``target`` (``link``: make ``target`` a symlink to that asset's file first)."""
    def setup(tmp: Path, assets: dict) -> None:
        model = tmp / "model"
        (model / "model.safetensors").unlink()
        if link is not None:
            (model / target).symlink_to(assets[link] / "model.safetensors")
        (model / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"model.embed_tokens.weight": target}}))
    return setup


def fake_checkpoint(config_yaml: str):
    """A setup: ``{tmp}/run/checkpoints/step-0000001``, committed (its marker), holding
    only a config.yaml of the given text."""
    def setup(tmp: Path, assets: dict) -> None:
        step = tmp / "run" / "checkpoints" / "step-0000001"
        step.mkdir(parents=True)
        (step / "COMPLETE").write_text('{"step": 1}\n')
        (step / "config.yaml").write_text(config_yaml)
    return setup


def steps(*setups):
    def setup(tmp: Path, assets: dict) -> None:
        for s in setups:
            s(tmp, assets)
    return setup


# Command lines and setups the model-directory, adapter and generate rows share.
GEN = ["generate", "--model", "{tmp}/model", "--prompt", "hi"]  # on the row's model copy
MERGE = ["lora", "merge", "--model", "{model}", "--adapter", "{tmp}/adapter", "--output",
         "{tmp}/out"]


def model_with(*setups):
    return steps(copy_asset("model"), *setups)


def adapter_with(*setups):
    return steps(copy_asset("adapter"), *setups)


def adapter_config(**changes):
    return adapter_with(edit_json("adapter/adapter_config.json", **changes))


# ----------------------------------------------------------------- the table
# Sections by command; keep a row's name unique (it is the test id).

HUGE_CPU_RUN = ["model.preset=llama3-70b", "model.vocab_size=128256", "data.seq_len=4096",
                "train.device=cpu"]
OVER_MEMORY = (r"^memory: the run needs about \d+\.\d GiB per device .* GiB; try .*"
               r"train\.skip_memory_check=true")
# A config that would run a command if it were read by an unsafe YAML loader.
PYTHON_TAG_YAML = 'train:\n  seed: 1\noptim: !!python/object/apply:os.system ["touch F"]\n'
PYTHON_TAG_REFUSED = r"the YAML tag !!python/object/apply:os\.system is refused"
# /proc takes no new files, whatever its permission bits say (root passes those).
PROC_REFUSED = r"(/proc does not accept new files|no permission to create files in /proc)"
LAUNCH_ARGS = ["launch", "slurm", "--nodes", "1", "--gpus-per-node", "1", "--env", "none",
               "--output", "{tmp}/job.sbatch"]

TRAIN = [
    Bad("negative lr", ["train", "optim.lr=-1", "train.output_dir={tmp}/run"],
        r"optim\.lr"),
    Bad("infinite lr", ["train", "optim.lr=inf", "train.output_dir={tmp}/run"],
        r"optim\.lr"),
    Bad("unknown key", ["train", "optim.nope=1", "train.output_dir={tmp}/run"],
        r"optim\.nope"),
    Bad("unknown preset", ["train", "model.preset=gpt5", "train.output_dir={tmp}/run"],
        r"model\.preset"),
    Bad("missing config file", ["train", "{tmp}/nope.yaml"], r"nope\.yaml: not found"),
    Bad("missing init_from", ["train", "model.init_from={tmp}/absent",
                              "train.output_dir={tmp}/run"],
        r"model\.init_from"),
    # A full 70B training step on the CPU: about 2.6 TiB per process, over any CI machine.
    Bad("model over the machine's memory", ["train", *HUGE_CPU_RUN,
                                            "train.output_dir={tmp}/run"], OVER_MEMORY),
    Bad("dry run of a model over the machine's memory",
        ["train", "--dry-run", *HUGE_CPU_RUN, "train.output_dir={tmp}/run"], OVER_MEMORY),
    Bad("negative seed", ["train", "train.seed=-1", "train.output_dir={tmp}/run"],
        r"^train\.seed: must be in \[0, 2\^63\), got -1"),
    Bad("zero eval batches", ["train", "train.eval_batches=0", "train.output_dir={tmp}/run"],
        r"^train\.eval_batches: must be > 0"),
    Bad("negative sample tokens", ["train", "train.sample_tokens=-1",
                                   "train.output_dir={tmp}/run"],
        r"^train\.sample_tokens: must be >= 0"),
    Bad("infinite rope theta", ["train", "model.rope_theta=inf", "train.output_dir={tmp}/run"],
        r"^model\.rope_theta: inf is not a finite number"),
    Bad("zero norm eps", ["train", "model.norm_eps=0", "train.output_dir={tmp}/run"],
        r"^model\.norm_eps: must be > 0"),
    Bad("nan lora alpha", ["train", "lora.alpha=nan", "train.output_dir={tmp}/run"],
        r"^lora\.alpha: nan is not a finite number"),
    Bad("zero dp_shard", ["train", "parallel.dp_shard=0", "train.output_dir={tmp}/run"],
        r"^parallel\.dp_shard: must be -1 \(the rest of the world size\) or >= 1, got 0"),
    Bad("config with a python tag", ["train", "{tmp}/evil.yaml", "train.output_dir={tmp}/run"],
        r"^{tmp}/evil\.yaml:3: " + PYTHON_TAG_REFUSED, setup=write("evil.yaml", PYTHON_TAG_YAML)),
    Bad("config with a yaml syntax error", ["train", "{tmp}/bad.yaml"],
        r"^{tmp}/bad\.yaml:3: not valid YAML", setup=write("bad.yaml", "train:\n  seed: [1,\n")),
]

MODEL_DIRS = [
    Bad("broken config.json", ["generate", "--model", "{tmp}/model", "--prompt", "hi"],
        r"config\.json", setup=steps(copy_asset("model"), write("model/config.json", "{x"))),
    Bad("zero attention heads", GEN, r"config\.json: num_attention_heads: 0 is not a positive",
        setup=model_with(edit_json("model/config.json", num_attention_heads=0))),
    Bad("kv heads not dividing heads", GEN,
        r"config\.json: num_attention_heads: 4 is not a multiple of num_key_value_heads \(3\)",
        setup=model_with(edit_json("model/config.json", num_key_value_heads=3))),
    Bad("hidden size as a string", GEN, r"config\.json: hidden_size: '32' is not a positive",
        setup=model_with(edit_json("model/config.json", hidden_size="32"))),
    Bad("nan rms_norm_eps", GEN, r"config\.json: rms_norm_eps: nan is not a positive finite",
        setup=model_with(edit_json("model/config.json", rms_norm_eps=float("nan")))),
    Bad("infinite rope_theta", GEN, r"config\.json: rope_theta: inf is not a positive finite",
        setup=model_with(edit_json("model/config.json", rope_theta=float("inf")))),
    Bad("shard path climbing out of the model dir", GEN,
        r"model\.safetensors\.index\.json: weight_map\['model\.embed_tokens\.weight'\] = "
        r"'\.\./\.\./\.\./etc/passwd': not a plain file name",
        setup=model_with(shard_index("../../../etc/passwd"))),
    Bad("absolute shard path", GEN,
        r"model\.safetensors\.index\.json: weight_map\[.*\] = '/etc/passwd': not a plain",
        setup=model_with(shard_index("/etc/passwd"))),
    Bad("shard symlink leaving the model dir", GEN,
        r"model\.safetensors\.index\.json: weight_map\[.*\] = 'model-1\.safetensors': a link "
        r"to .* outside the directory",
        setup=model_with(shard_index("model-1.safetensors", link="model"))),
    Bad("nan in a weight", GEN, r"model\.safetensors: tensor model\.layers\.0\.\S+ holds NaN",
        setup=model_with(edit_tensors("model/model.safetensors",
                                      poison("layers.0.self_attn.q_proj", float("nan"))))),
    Bad("inf in a weight", GEN, r"model\.safetensors: tensor model\.norm\.weight holds NaN or Inf",
        setup=model_with(edit_tensors("model/model.safetensors",
                                      poison("model.norm", float("inf"))))),
    Bad("eos_token_id as a string", GEN,
        r"generation_config\.json: eos_token_id: 'end' is not a token id",
        setup=model_with(edit_json("model/generation_config.json", eos_token_id="end"))),
    Bad("fine-tune of a model with zero attention heads",
        ["train", "model.init_from={tmp}/model", "data.kind=sft", "data.path={chat}",
         "train.output_dir={tmp}/run"],
        r"^{tmp}/model/config\.json: num_attention_heads: 0 is not a positive integer",
        setup=model_with(edit_json("model/config.json", num_attention_heads=0))),
]

ADAPTERS = [
    Bad("negative r and nan alpha", MERGE,
        r"adapter_config\.json: r: -4 is not a positive integer",
        setup=adapter_config(r=-4, lora_alpha="nan")),
    Bad("alpha as the string nan", MERGE,
        r"adapter_config\.json: lora_alpha: 'nan' is not a positive finite number",
        setup=adapter_config(lora_alpha="nan")),
    Bad("infinite alpha", MERGE,
        r"adapter_config\.json: lora_alpha: inf is not a positive finite number",
        setup=adapter_config(lora_alpha=float("inf"))),
    Bad("zero r", MERGE, r"adapter_config\.json: r: 0 is not a positive integer",
        setup=adapter_config(r=0)),
    Bad("r off the tensors' rank", MERGE,
        r"adapter_config\.json: r: 1000000 does not match the rank 4 of model\.layers\.\d+\.",
        setup=adapter_config(r=1000000)),
    Bad("target module the base lacks", MERGE,
        r"adapter_config\.json: target_modules: 'nonexistent_proj' matches no linear layer",
        setup=adapter_config(target_modules=["nonexistent_proj"])),
    Bad("weights for an untargeted module", MERGE,
        r"adapter_model\.safetensors: holds weights for model\.layers\.\d+\.self_attn\.v_proj,"
        r" which adapter_config\.json does not target \(target_modules: \['q_proj'\]\)",
        setup=adapter_config(target_modules=["q_proj"])),
    Bad("dropout above one", MERGE, r"adapter_config\.json: lora_dropout: 1\.5 is not",
        setup=adapter_config(lora_dropout=1.5)),
    Bad("DoRA adapter", MERGE, r"adapter_config\.json: use_dora = True is not supported",
        setup=adapter_config(use_dora=True)),
    Bad("PiSSA adapter", MERGE,
        r"adapter_config\.json: init_lora_weights = 'pissa' is not supported",
        setup=adapter_config(init_lora_weights="pissa")),
    Bad("unknown adapter setting", MERGE,
        r"adapter_config\.json: mystery_config = \{'on': True\} is a setting lmforge does not",
        setup=adapter_config(mystery_config={"on": True})),
    Bad("nan in an adapter tensor", MERGE,
        r"adapter_model\.safetensors: tensor base_model\.model\.\S+\.lora_B\.weight holds NaN",
        setup=adapter_with(edit_tensors("adapter/adapter_model.safetensors",
                                        poison("lora_B", float("nan"))))),
    Bad("eval-sft of a bad adapter", ["eval-sft", "--model", "{model}", "--adapter",
                                       "{tmp}/adapter", "--data", "{chat}", "--output",
                                       "{tmp}/r.json"],
        r"adapter_config\.json: r: -4", setup=adapter_config(r=-4)),
    Bad("generate with a bad adapter", ["generate", "--model", "{model}", "--adapter",
                                        "{tmp}/adapter", "--prompt", "hi"],
        r"adapter_config\.json: lora_alpha: inf", setup=adapter_config(lora_alpha=float("inf"))),
]

NOT_UTF8 = bytes(range(128, 256)) * 160  # 20 KB of bytes no UTF-8 decoder accepts

DATA = [
    Bad("text corpus of random bytes",
        ["train", "data.kind=text", "data.path={tmp}/noise.bin", "train.output_dir={tmp}/run"],
        r"^data\.path: {tmp}/noise\.bin:1: not valid UTF-8 \(byte 0x80 at byte offset 0",
        setup=write("noise.bin", NOT_UTF8)),
    Bad("text corpus with a broken JSON line",
        ["train", "data.kind=text", "data.path={tmp}/c.jsonl", "train.output_dir={tmp}/run"],
        r"^data\.path: {tmp}/c\.jsonl:2: not valid JSON",
        setup=write("c.jsonl", '{"text": "fine"}\n{"text": "cut\n')),
    Bad("text corpus of empty records",
        ["train", "data.kind=text", "data.path={tmp}/c.jsonl", "train.output_dir={tmp}/run"],
        r"^data\.path: {tmp}/c\.jsonl: no text to train on",
        setup=write("c.jsonl", '{"text": ""}\n{"text": ""}\n')),
    Bad("text eval_path without text",
        ["train", "data.kind=text", "data.path={text}", "data.eval_path={tmp}/held.txt",
         "train.output_dir={tmp}/run"],
        r"^data\.eval_path: {tmp}/held\.txt: no text to train on",
        setup=write("held.txt", "\n\n")),
    Bad("SFT file of empty answers only",
        ["train", "model.init_from={model}", "data.kind=sft", "data.path={tmp}/chat.jsonl",
         "data.seq_len=64", "train.output_dir={tmp}/run"],
        r"^data\.path: {tmp}/chat\.jsonl: every record's assistant answer is empty",
        setup=write("chat.jsonl", '{"prompt": "hi", "response": ""}\n' * 3)),
    Bad("preference objective on SFT data",
        ["train", "model.init_from={model}", "data.kind=sft", "data.path={tmp}/chat.jsonl",
         "train.objective=dpo", "train.output_dir={tmp}/run"],
        r"^train\.objective: dpo compares chosen and rejected completions; it needs "
        r"data\.kind=preference", setup=write("chat.jsonl", '{"prompt": "hi", "response": "a"}\n')),
    Bad("preference pairs with the next-token objective",
        ["train", "model.init_from={model}", "data.kind=preference",
         "data.path={tmp}/pairs.jsonl", "train.objective=next_token",
         "train.output_dir={tmp}/run"],
        r"^train\.objective: next_token does not train on preference pairs",
        setup=write("pairs.jsonl", '{"prompt": "hi", "chosen": "a", "rejected": "b"}\n')),
    Bad("preference pairs in a pipeline",
        ["train", "model.init_from={model}", "data.kind=preference",
         "data.path={tmp}/pairs.jsonl", "parallel.pp=2", "parallel.dp_shard=1",
         "train.output_dir={tmp}/run"],
        r"^parallel\.pp: the preference objectives do not run in a pipeline",
        setup=write("pairs.jsonl", '{"prompt": "hi", "chosen": "a", "rejected": "b"}\n')),
    Bad("preference record without rejected",
        ["train", "model.init_from={model}", "data.kind=preference",
         "data.path={tmp}/pairs.jsonl", "data.seq_len=64", "train.output_dir={tmp}/run"],
        r"^{tmp}/pairs\.jsonl:1: missing key 'rejected'",
        setup=write("pairs.jsonl", '{"prompt": "hi", "chosen": "a"}\n')),
    Bad("preprocess of an empty file",
        ["preprocess", "--input", "{tmp}/empty.jsonl", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}"],
        r"^--input {tmp}/empty\.jsonl: no documents to write",
        setup=write("empty.jsonl", "")),
    Bad("tokenizer train on an empty file",
        ["tokenizer", "train", "--input", "{tmp}/empty.txt", "--vocab-size", "300",
         "--output", "{tmp}/tok"],
        r"^--input {tmp}/empty\.txt: no text to train a tokenizer on",
        setup=write("empty.txt", "")),
    Bad("preprocess to a prefix another job writes",
        ["preprocess", "--input", "{text}", "--output-prefix", "{tmp}/p",
         "--tokenizer", "{tokenizer}"],
        r"^--output-prefix: {tmp}/p is being written by another preprocess \(pid \d+",
        setup=hold_lock("p.lock")),
    Bad("pretraining on a .bin and .idx from two writes",
        ["train", "data.kind=pretrain", "data.path={tmp}/a", "model.tokenizer={tokenizer}",
         "train.output_dir={tmp}/run"],
        r"^{tmp}/a\.bin and {tmp}/a\.idx are not one pair", setup=same_shape_pairs),
    Bad("negative pad_to_multiple_of", ["train", "data.pad_to_multiple_of=-8",
                                        "train.output_dir={tmp}/run"],
        r"data\.pad_to_multiple_of: must be >= 0"),
    Bad("SFT grouped by length and packed",
        ["train", "model.init_from={model}", "data.kind=sft", "data.path={chat}",
         "data.pack=true", "data.group_by_length=true", "train.output_dir={tmp}/run"],
        r"^data\.group_by_length: cannot be combined with data\.pack=true \(packing already "
        r"removes the padding\)"),
]

GENERATE = [
    Bad("nan temperature", ["generate", "--model", "{model}", "--prompt", "hi",
                            "--temperature", "nan"], r"^--temperature: nan must be"),
    Bad("negative temperature", ["generate", "--model", "{model}", "--prompt", "hi",
                                 "--temperature", "-0.5"], r"^--temperature: -0\.5 must be"),
    Bad("top-p above one", ["generate", "--model", "{model}", "--prompt", "hi", "--top-p", "2"],
        r"^--top-p: 2\.0 must be in \(0, 1\]"),
    Bad("top-p zero", ["generate", "--model", "{model}", "--prompt", "hi", "--top-p", "0"],
        r"^--top-p: 0\.0 must be in"),
    Bad("negative top-k", ["generate", "--model", "{model}", "--prompt", "hi", "--top-k", "-3"],
        r"^--top-k: -3 must be >= 0"),
    Bad("no new tokens", ["generate", "--model", "{model}", "--prompt", "hi",
                          "--max-new-tokens", "0"], r"^--max-new-tokens: 0 must be > 0"),
    Bad("chat template that raises", GEN + ["--chat"],
        r"tokenizer_config\.json: chat_template: the chat template cannot render this "
        r"conversation \(no user turns here\)",
        setup=model_with(edit_json("model/tokenizer_config.json",
                                   chat_template="{{ raise_exception('no user turns here') }}"))),
    Bad("chat_template.jinja that does not parse", GEN + ["--chat"],
        r"model/chat_template\.jinja: the chat template does not parse",
        setup=model_with(write("model/chat_template.jinja", "{% if %}"))),
]

LAUNCH = [
    Bad("job name with a newline", [*LAUNCH_ARGS, "--job-name", "x\ntouch F"],
        r"^--job-name: 'x\\ntouch F' is refused: it must be letters, digits"),
    Bad("job name with a command", [*LAUNCH_ARGS, "--job-name", "$(touch F)"],
        r"^--job-name: '\$\(touch F\)' is refused"),
    Bad("partition with a space", [*LAUNCH_ARGS, "--partition", "gpu --wrap=touch"],
        r"^--partition: 'gpu --wrap=touch' is refused"),
    Bad("account with a newline", [*LAUNCH_ARGS, "--account", "proj\n#SBATCH --wrap=x"],
        r"^--account: .* is refused"),
    Bad("time with a newline", [*LAUNCH_ARGS, "--time", "1:00:00\ntouch F"],
        r"^--time: .* is refused: it must be MINUTES"),
    Bad("time not in slurm's forms", [*LAUNCH_ARGS, "--time", "1h"],
        r"^--time: '1h' is refused"),
    Bad("setup line with a newline", [*LAUNCH_ARGS, "--setup", "module load x\ntouch F"],
        r"^--setup: .* holds a control character \(U\+000A\)"),
    Bad("setup line with a carriage return", [*LAUNCH_ARGS, "--setup", "echo a\rtouch F"],
        r"^--setup: .* holds a control character \(U\+000D\)"),
    Bad("override with a newline", [*LAUNCH_ARGS, "train.output_dir={tmp}/a\ntouch F"],
        r"^override: .* holds a control character"),
    Bad("config path with a newline", [*LAUNCH_ARGS, "{tmp}/a\nb.yaml"],
        r"^CONFIG: .* holds a control character",
        setup=write("a\nb.yaml", "train:\n  seed: 1\n")),
    Bad("env path with a newline", [*LAUNCH_ARGS, "--env", "{tmp}/v\nx"],
        r"^--env: .* holds a control character", setup=write("v\nx/bin/activate", "")),
    Bad("zero nodes", [*LAUNCH_ARGS, "--nodes", "0"], r"^--nodes: must be >= 1, got 0"),
    Bad("zero cpus per task", [*LAUNCH_ARGS, "--cpus-per-task", "0"],
        r"^--cpus-per-task: must be >= 1"),
    Bad("port out of range", [*LAUNCH_ARGS, "--port", "70000"],
        r"^--port: must be a TCP port in \[1, 65535\], got 70000"),
    Bad("stop-before past slurm's limit", [*LAUNCH_ARGS, "--stop-before", "70000"],
        r"^--stop-before: must be in \[1, 65535\]"),
    Bad("stop-before longer than the time limit", [*LAUNCH_ARGS, "--time", "10",
                                                    "--stop-before", "600"],
        r"^--stop-before: 600 s is not shorter than --time 10 \(600 s\)"),
    Bad("launch script under /proc", [*LAUNCH_ARGS, "--output", "/proc/lmforge.sbatch"],
        r"^/proc/lmforge\.sbatch: cannot write --output: " + PROC_REFUSED),
]

EXPORT_AND_EVAL = [
    Bad("eval of a missing model", ["eval", "--model", "{tmp}/absent", "--data", "{text}"],
        r"absent"),
    Bad("eval output under /proc", ["eval", "--model", "{model}", "--data", "{text}",
                                    "--output", "/proc/lmforge-eval.json"],
        r"^/proc/lmforge-eval\.json: cannot write --output: " + PROC_REFUSED),
    Bad("preprocess output prefix under /proc",
        ["preprocess", "--input", "{text}", "--output-prefix", "/proc/lmforge-tokens",
         "--tokenizer", "{tokenizer}"],
        r"^/proc/lmforge-tokens\.bin: cannot write --output-prefix: " + PROC_REFUSED),
    Bad("tokenizer output under /proc", ["tokenizer", "train", "--input", "{text}",
                                         "--vocab-size", "300", "--output", "/proc/lmforge-tok"],
        r"^/proc/lmforge-tok: cannot write --output: " + PROC_REFUSED),
    Bad("export under /proc", ["export", "{tmp}/run", "/proc/lmforge-export"],
        r"^/proc/lmforge-export: cannot write OUT_DIR: " + PROC_REFUSED,
        setup=fake_checkpoint("train:\n  seed: 1\n")),
    Bad("lora merge under /proc", ["lora", "merge", "--model", "{model}", "--adapter",
                                   "{adapter}", "--output", "/proc/lmforge-merged"],
        r"^/proc/lmforge-merged: cannot write --output: " + PROC_REFUSED),
    Bad("lora eval output under /proc", ["lora", "eval", "--model", "{model}", "--data",
                                         "{chat}", "--output", "/proc/lmforge-lora.json"],
        r"^/proc/lmforge-lora\.json: cannot write --output: " + PROC_REFUSED),
    Bad("report under /proc", ["report", "{tmp}/run", "--output", "/proc/lmforge-report"],
        r"^/proc/lmforge-report: cannot write --output: " + PROC_REFUSED),
    Bad("plan output under /proc", ["plan", "--gpus", "8", "--output", "/proc/plan.yaml"],
        r"^/proc/plan\.yaml: cannot write --output: " + PROC_REFUSED),
    Bad("checkpoint config with a python tag", ["export", "{tmp}/run", "{tmp}/out"],
        r"^{tmp}/run/checkpoints/step-0000001/config\.yaml:3: " + PYTHON_TAG_REFUSED,
        setup=fake_checkpoint(PYTHON_TAG_YAML)),
    Bad("checkpoint config with a yaml syntax error", ["export", "{tmp}/run", "{tmp}/out"],
        r"^{tmp}/run/checkpoints/step-0000001/config\.yaml:3: not valid YAML \(expected "
        r"',' or '\]', but got '<stream end>'; while parsing a flow sequence from line 2\)",
        setup=fake_checkpoint("train:\n  seed: [1\n")),
    Bad("eval beyond the model's positions", ["eval", "--model", "{model}", "--data",
                                              "{text}", "--seq-len", "100000"],
        r"^--seq-len: 100000 is above the model's maximum sequence length \d+"),
    Bad("export of a directory without checkpoints", ["export", "{tmp}", "{tmp}/out"],
        r"{tmp}"),
    Bad("estimate of a negative lr", ["estimate", "optim.lr=-1"], r"^optim\.lr"),
    Bad("estimate of an unknown preset", ["estimate", "model.preset=gpt5"],
        r"^model\.preset"),
    Bad("plan on zero gpus", ["plan", "--gpus", "0"], r"--gpus"),
    Bad("report of a missing run", ["report", "{tmp}/absent"], r"{tmp}/absent"),
]

TABLE = TRAIN + MODEL_DIRS + ADAPTERS + DATA + GENERATE + LAUNCH + EXPORT_AND_EVAL


def test_row_names_are_unique():
    names = [row.name for row in TABLE]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name, marks=r.marks) for r in TABLE])
def test_bad_input_is_refused_in_one_line(row: Bad, assets, tmp_path, capsys,
                                          monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    if row.setup:
        row.setup(tmp_path, assets)
    names = {**{k: str(v) for k, v in assets.items()}, "tmp": str(tmp_path)}
    before = set(tmp_path.rglob("*"))
    code = main([_fill(arg, names) for arg in row.argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"exit {code}; stderr: {err!r}"
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("lmforge: error: "), err
    assert re.search(_fill(row.message, {k: re.escape(v) for k, v in names.items()}),
                     err[len("lmforge: error: "):]), err
    assert set(tmp_path.rglob("*")) == before, "wrote " + ", ".join(
        str(p.relative_to(tmp_path)) for p in set(tmp_path.rglob("*")) - before)


def _fill(text: str, names: dict) -> str:
    """``{name}`` replaced by its value (not str.format: a regex has braces of its own)."""
    for key, value in names.items():
        text = text.replace("{" + key + "}", value)
    return text
