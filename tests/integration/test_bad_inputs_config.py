"""Bad-input table of the config itself (issue 37, point 8): unknown keys inside a mapping
value (model.rope_scaling), settings the chosen objective or setup ignores, values too
large to show (a YAML alias bomb, a long list), each refused in one short line naming the
key or the file:line at fault. The harness: tests/helpers/bad_inputs.py."""
from __future__ import annotations

import shutil
import time

import pytest

from helpers.bad_inputs import Bad, check_refused, copy_asset, fill, params, steps, write
from lmforge.cli import main

RUN = "train.output_dir={tmp}/run"
PAIRS = ["data.kind=preference", "data.path={chat}"]  # (the refusal comes before it is read)
SHORT = r".{0,160}$"  # a shown value is cut: the whole line stays short


def alias_bomb(levels: int = 8, width: int = 9) -> str:
    """A flow list whose every item is the anchor before it, ``width`` times: a few
    hundred bytes that expand to width^levels strings (the "billion laughs" shape)."""
    items = ['&a [' + ", ".join(['"lol"'] * width) + ']']
    for i in range(1, levels):
        items.append(f"&{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * width) + "]")
    return "[" + ", ".join(items) + "]"


def long_list(n: int = 20000) -> str:
    return "[" + ", ".join(["1"] * n) + "]"


TABLE = [
    # ------------------------------------- chat data and no tokenizer: nothing trains one
    *(Bad(f"SFT data and no tokenizer ({mode})",
          ["train", *flags, RUN, "model.preset=debug", "data.kind=sft",
           "data.path={tmp}/chat.jsonl"],
          r"^model\.tokenizer: required for data\.kind sft \(only raw-text corpora can "
          r"train one\)$", setup=write("chat.jsonl", '{"prompt": "hi", "response": "yo"}\n'))
      for mode, flags in (("the dry run", ["--dry-run"]), ("the run", []))),
    # -------------------------------------------------- a mapping's keys, like any key's
    Bad("an unknown key of model.rope_scaling",
        ["train", "--dry-run", RUN, "model.rope_scaling={rope_type: yarn, factor: 4, bogus: 1}"],
        r"^model\.rope_scaling\.bogus: unknown key for rope_type yarn \(known: rope_type, "
        r"factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor, "
        r"truncate\)$"),
    Bad("an unknown key of model.rope_scaling in a YAML file",
        ["train", "--dry-run", "{tmp}/c.yaml", RUN],
        r"^model\.rope_scaling\.factr: unknown key for rope_type linear \(known: rope_type, "
        r"factor\)$",
        setup=write("c.yaml", "model:\n  rope_scaling:\n    rope_type: linear\n"
                              "    factor: 2\n    factr: 4\n")),
    Bad("a yarn key in a llama3 rope_scaling",
        ["train", "--dry-run", RUN, "model.rope_scaling={rope_type: llama3, factor: 8, "
         "low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 128, "
         "beta_fast: 32}"],
        r"^model\.rope_scaling\.beta_fast: unknown key for rope_type llama3 \(known: "
        r"rope_type, factor, low_freq_factor, high_freq_factor, "
        r"original_max_position_embeddings\)$"),
    Bad("DeepSeek's mscale in a yarn rope_scaling",
        ["train", "--dry-run", RUN, "model.rope_scaling={type: yarn, factor: 4, mscale: 1}"],
        r"^model\.rope_scaling\.mscale: unknown key for rope_type yarn \(known: type, "),
    Bad("a factor with rope_type default",
        ["train", "--dry-run", RUN, "model.rope_scaling={rope_type: default, factor: 4}"],
        r"^model\.rope_scaling\.factor: unknown key for rope_type default \(known: "
        r"rope_type\)$"),
    Bad("an unknown rope_type",
        ["train", "--dry-run", RUN, "model.rope_scaling={rope_type: ntk, factor: 4}"],
        r"^model\.rope_scaling\.rope_type: 'ntk' is not one of default, linear, llama3, "
        r"yarn$"),
    Bad("one key of model.rope_scaling as an override",
        ["train", "--dry-run", RUN, "model.rope_scaling.factor=4"],
        r"^model\.rope_scaling\.factor: model\.rope_scaling is set as a whole mapping "
        r"\(model\.rope_scaling=\{factor: \.\.\., \.\.\.\}\)$"),
    Bad("a rope_scaling that is not a mapping",
        ["train", "--dry-run", RUN, "model.rope_scaling=" + long_list()],
        r"^model\.rope_scaling: \[1, 1, .{0,80} is not a mapping" + SHORT),
    Bad("a mapping for data.path",
        ["train", "--dry-run", RUN, "data.kind=text", "data.path={a: 1}"],
        r"^data\.path: \{'a': 1\} is not a path or a list of paths$"),
    Bad("a number in data.eval_path's list",
        ["train", "--dry-run", RUN, "data.kind=text", "data.path={text}",
         "data.eval_path=[a, 3]"],
        r"^data\.eval_path: \['a', 3\] is not a path or a list of paths$"),
    # ------------------------------------------ settings the run would silently ignore
    Bad("ORPO with label smoothing",
        ["train", "--dry-run", RUN, *PAIRS, "train.objective=orpo",
         "train.label_smoothing=0.2"],
        r"^train\.label_smoothing: orpo does not use it \(it applies to dpo, simpo\)$"),
    Bad("IPO with label smoothing",
        ["train", "--dry-run", RUN, *PAIRS, "train.objective=ipo",
         "train.label_smoothing=0.1"],
        r"^train\.label_smoothing: ipo does not use it \(it applies to dpo, simpo\)$"),
    Bad("SimPO with a precomputed reference",
        ["train", "--dry-run", RUN, *PAIRS, "train.objective=simpo",
         "train.reference=precomputed"],
        r"^train\.reference: simpo does not use it \(it applies to dpo, ipo\)$"),
    Bad("ORPO with a precomputed reference",
        ["train", "--dry-run", RUN, *PAIRS, "train.objective=orpo",
         "train.reference=precomputed"],
        r"^train\.reference: orpo does not use it \(it applies to dpo, ipo\)$"),
    Bad("ORPO with beta",
        ["train", "--dry-run", RUN, *PAIRS, "train.objective=orpo", "train.beta=0.5"],
        r"^train\.beta: orpo does not use it \(it applies to dpo, ipo, simpo\)$"),
    Bad("DPO (auto) with simpo_gamma",
        ["train", "--dry-run", RUN, *PAIRS, "train.simpo_gamma=1.0"],
        r"^train\.simpo_gamma: dpo does not use it \(it applies to simpo\)$"),
    Bad("DPO with orpo_lambda",
        ["train", "--dry-run", RUN, *PAIRS, "train.objective=dpo", "train.orpo_lambda=0.5"],
        r"^train\.orpo_lambda: dpo does not use it \(it applies to orpo\)$"),
    Bad("next-token training with beta",
        ["train", "--dry-run", RUN, "train.beta=0.3"],
        r"^train\.beta: next_token does not use it \(it applies to dpo, ipo, simpo\)$"),
    Bad("next-token training with a precomputed reference",
        ["train", "--dry-run", RUN, "train.reference=precomputed"],
        r"^train\.reference: next_token does not use it \(it applies to dpo, ipo\)$"),
    Bad("max_prompt_len without preference pairs",
        ["train", "--dry-run", RUN, "data.max_prompt_len=64"],
        r"^data\.max_prompt_len: data\.kind=stdlib does not use it \(it applies to "
        r"data\.kind=preference\)$"),
    Bad("a LoRA rank with LoRA off",
        ["train", "--dry-run", RUN, "lora.rank=16"],
        r"^lora\.rank: lora\.enabled=false does not use it \(it applies to "
        r"lora\.enabled=true\)$"),
    Bad("LoRA targets with LoRA off",
        ["train", "--dry-run", RUN, "lora.targets=all-linear"],
        r"^lora\.targets: lora\.enabled=false does not use it"),
    Bad("harness options without harness tasks",
        ["train", "--dry-run", RUN, "eval.harness_limit=10"],
        r"^eval\.harness_limit: a run without eval\.harness_tasks does not use it"),
    Bad("an MLflow experiment without the MLflow tracker",
        ["train", "--dry-run", RUN, "metrics.mlflow_experiment=mine"],
        r"^metrics\.mlflow_experiment: metrics\.tracker=tensorboard does not use it "
        r"\(it applies to metrics\.tracker with mlflow\)$"),
    Bad("a W&B project without the W&B tracker",
        ["train", "--dry-run", RUN, "metrics.tracker=none", "metrics.wandb_project=p"],
        r"^metrics\.wandb_project: metrics\.tracker=none does not use it"),
    Bad("every-n-th checkpointing without selective",
        ["train", "--dry-run", RUN, "train.activation_checkpointing_every=3"],
        r"^train\.activation_checkpointing_every: train\.activation_checkpointing=none does "
        r"not use it \(it applies to train\.activation_checkpointing=selective\)$"),
    Bad("a pipeline schedule without a pipeline",
        ["train", "--dry-run", RUN, "parallel.pp_schedule=gpipe"],
        r"^parallel\.pp_schedule: parallel\.pp=1 does not use it \(it applies to "
        r"parallel\.pp > 1\)$"),
    Bad("a blend without pretrain data",
        ["train", "--dry-run", RUN, "data.blend=[1, a]"],
        r"^data\.blend: data\.kind=stdlib does not use it \(it applies to "
        r"data\.kind=pretrain\)$"),
    # the same rule for lmforge eval's options on preference pairs
    Bad("eval: ORPO with label smoothing",
        ["eval", "--model", "{model}", "--data", "{chat}", "--objective", "orpo",
         "--label-smoothing", "0.2"],
        r"^--label-smoothing: orpo does not use it \(it applies to --objective dpo, "
        r"simpo\)$"),
    Bad("eval: SimPO with a reference model",
        ["eval", "--model", "{model}", "--data", "{chat}", "--objective", "simpo",
         "--reference", "{model}"],
        r"^--reference: simpo does not use it \(it applies to --objective dpo, ipo\)$"),
    Bad("eval: IPO with simpo_gamma",
        ["eval", "--model", "{model}", "--data", "{chat}", "--objective", "ipo",
         "--reference", "{model}", "--simpo-gamma", "1"],
        r"^--simpo-gamma: ipo does not use it \(it applies to --objective simpo\)$"),
    Bad("eval: beta without an objective",
        ["eval", "--model", "{model}", "--data", "{text}", "--beta", "0.5"],
        r"^--beta: an evaluation without --objective does not use it \(it applies to "
        r"--objective dpo, ipo, simpo\)$"),
    Bad("eval: an adapter without an objective",
        ["eval", "--model", "{model}", "--data", "{text}", "--adapter", "{adapter}"],
        r"^--adapter: an evaluation without --objective does not use it"),
    Bad("eval: a prompt limit without an objective",
        ["eval", "--model", "{model}", "--data", "{text}", "--max-prompt-len", "8"],
        r"^--max-prompt-len: an evaluation without --objective does not use it"),
    # ------------------------------------------------ no value is shown unbounded
    Bad("a YAML alias bomb in a config file",
        ["train", "--dry-run", "{tmp}/bomb.yaml", RUN],
        r"^{tmp}/bomb\.yaml:2: YAML aliases here expand to more than [\d,]+ values" + SHORT,
        setup=write("bomb.yaml", "train:\n  seed: " + alias_bomb() + "\n")),
    Bad("a YAML alias bomb in an override",
        ["train", "--dry-run", RUN, "train.seed=" + alias_bomb()],
        r"^train\.seed: YAML aliases expand to more than [\d,]+ values" + SHORT),
    Bad("a YAML alias that contains itself",
        ["train", "--dry-run", "{tmp}/loop.yaml", RUN],
        r"^{tmp}/loop\.yaml:2: a YAML alias refers to the list or mapping that holds it" + SHORT,
        setup=write("loop.yaml", "train:\n  seed: &a [1, *a]\n")),
    Bad("a long list for an integer",
        ["train", "--dry-run", RUN, "train.seed=" + long_list()],
        r"^train\.seed: expected an integer, got \[1, 1, " + SHORT),
    Bad("a long string for a choice",
        ["train", "--dry-run", RUN, "train.device=" + "x" * 100000],
        r"^train\.device: 'xxx.{0,80}' is not one of auto, cpu, cuda$"),
    Bad("a long list of tracker names",
        ["train", "--dry-run", RUN, "metrics.tracker=" + long_list()],
        r"^metrics\.tracker: \[1, 1, .{0,80} is not a list of tracker names$"),
    Bad("a long list of harness tasks",
        ["train", "--dry-run", RUN, "eval.harness_tasks=" + long_list()],
        r"^eval\.harness_tasks: \[1, 1, .{0,80} is not a list of task names$"),
    Bad("an integer of 4000 digits",
        ["train", "--dry-run", "{tmp}/c.yaml", RUN],
        r"^train\.seed: must be in \[0, 2\^63\), got an integer of 4000 digits$",
        setup=write("c.yaml", "train:\n  seed: " + "9" * 4000 + "\n")),
    Bad("an integer over Python's 4300 digits in a YAML file",
        ["train", "--dry-run", "{tmp}/c.yaml", RUN],
        r"^{tmp}/c\.yaml: not valid YAML \(.{0,200}\)$",
        setup=write("c.yaml", "train:\n  seed: " + "9" * 5000 + "\n")),
    Bad("an integer over Python's 4300 digits in an override",
        ["train", "--dry-run", RUN, "train.seed=" + "9" * 5000],
        r"^train\.seed: expected an integer, got '9+\.\.\.9+'$"),
    Bad("an unknown key with a long name",
        ["train", "--dry-run", RUN, "optim." + "n" * 5000 + "=1"],
        r"^optim\.nnn.{0,80}: unknown key \(known in optim: " + r".{0,300}$"),
    # ------------------------------------ data.micro_batch_size: an integer or auto (issue 40)
    Bad("a micro-batch of 0",
        ["train", "--dry-run", RUN, "data.micro_batch_size=0"],
        r"^data\.micro_batch_size: must be > 0, or auto, got 0$"),
    Bad("a micro-batch of -1",
        ["train", "--dry-run", RUN, "data.micro_batch_size=-1"],
        r"^data\.micro_batch_size: must be > 0, or auto, got -1$"),
    Bad("a micro-batch that is almost auto",
        ["train", "--dry-run", RUN, "data.micro_batch_size=autox"],
        r"^data\.micro_batch_size: expected an integer or auto, got 'autox'$"),
    Bad("a micro-batch of Auto in a YAML file",
        ["train", "--dry-run", "{tmp}/c.yaml", RUN],
        r"^data\.micro_batch_size: expected an integer or auto, got 'Auto'$",
        setup=write("c.yaml", "data:\n  micro_batch_size: Auto\n")),
    Bad("a fractional micro-batch",
        ["train", "--dry-run", RUN, "data.micro_batch_size=2.5"],
        r"^data\.micro_batch_size: expected an integer or auto, got 2\.5$"),
    Bad("a micro-batch of true",
        ["train", "--dry-run", RUN, "data.micro_batch_size=true"],
        r"^data\.micro_batch_size: expected an integer or auto, got True$"),
    Bad("auto on the CPU",
        ["train", "--dry-run", RUN, "train.device=cpu", "data.micro_batch_size=auto"],
        r"^data\.micro_batch_size: auto sizes the micro-batch to a GPU's memory, and this "
        r"run is on the CPU"),
    Bad("auto with a global batch no rank count divides",
        ["train", "--dry-run", "--world-size", "2", RUN, "train.device=cpu",
         "data.micro_batch_size=auto", "data.global_batch_size=5"],
        r"^data\.global_batch_size: 5 must be a positive multiple of the data-parallel size "
        r"2 \(data\.micro_batch_size=auto divides each rank's share\)$"),
    Bad("auto in lmforge estimate without a device memory",
        ["estimate", "data.micro_batch_size=auto"],
        r"^data\.micro_batch_size: auto is sized to a device's memory"),
]


# --------------------------------------- messages name the user's paths, never a temp copy

def trained(out: str, *overrides: str):
    """A setup: a one-step run in ``{tmp}/<out>`` (its checkpoint and hf/)."""
    def setup(tmp, assets) -> None:
        names = {**{k: str(v) for k, v in assets.items()}, "tmp": str(tmp)}
        code = main(["train", "data.seq_len=32", "data.micro_batch_size=2",
                     "train.max_steps=1", "optim.warmup_steps=0", "train.device=cpu",
                     "train.sample_tokens=0", "metrics.tracker=none",
                     f"train.output_dir={tmp / out}", *[fill(o, names) for o in overrides]])
        assert code == 0
    return setup


def removed(path: str):
    def setup(tmp, assets) -> None:
        shutil.rmtree(tmp / path)
    return setup


TEMPORARY = [
    # the checkpoint is exported to HF in a temporary directory beside OUT first
    Bad("a GGUF export of a GPT-J checkpoint names the checkpoint",
        ["export", "{tmp}/run", "{tmp}/m.gguf", "--format", "gguf"],
        r"^{tmp}/run/checkpoints/step-0000001: no GGUF export of the gptj family",
        setup=trained("run", "model.preset=gptj-tiny")),
    # the adapter is exported to PEFT in a temporary directory first
    Bad("a GGUF-LoRA export whose base is gone names the checkpoint",
        ["export", "{tmp}/run", "{tmp}/a.gguf", "--format", "gguf-lora"],
        r"^--base: the base model directory of {tmp}/run/checkpoints/step-0000001 ",
        setup=steps(copy_asset("model"),
                    trained("run", "model.init_from={tmp}/model", "lora.enabled=true",
                            "data.kind=sft", "data.path={chat}"),
                    removed("model"))),
]


@pytest.mark.parametrize("row", params(TEMPORARY))
def test_a_message_names_the_users_path_not_a_temporary_copy(row, bad_input_assets, tmp_path,
                                                              capsys, monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    err = check_refused(row, bad_input_assets, tmp_path, capsys)
    assert "-hf-" not in err and ".tmp-" not in err


@pytest.mark.parametrize("row", params(TABLE))
def test_config_input_is_refused_in_one_line(row, bad_input_assets, tmp_path, capsys,
                                              monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    check_refused(row, bad_input_assets, tmp_path, capsys)


def test_an_alias_bomb_is_refused_fast_in_a_short_line(tmp_path, capsys, monkeypatch):
    """The 9^9-string bomb (431 bytes of YAML; 58 MB of message before) within a second."""
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("model:\n  preset: " + alias_bomb(levels=9) + "\n")
    start = time.monotonic()
    code = main(["train", "--dry-run", str(bomb), f"train.output_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and len(err) < 300, err[:1000]
    assert time.monotonic() - start < 5
