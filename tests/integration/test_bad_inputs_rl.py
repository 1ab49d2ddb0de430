"""Bad-input table of GRPO's configuration (issue 39): the rl section's keys, its rewards
and what it needs of the rest of the config, each refused in one line naming the key at
fault, before any model is built or a reward file is executed. (A reward that fails at
run time: tests/unit/train/test_rewards.py.) The harness: tests/helpers/bad_inputs.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers.bad_inputs import Bad, check_refused, params, steps, write

RUN = "train.output_dir={tmp}/run"
GRPO = ["train", "--dry-run", RUN, "train.objective=grpo"]
EXACT = [*GRPO, "rl.rewards=exact_answer"]
PAIRS = ["data.kind=preference", "data.path={chat}"]
REWARD_FILE = write("r.py", "def f(prompts, completions, **kwargs):\n    return []\n")
ON_PROMPTS = ["train", RUN, "model.init_from={model}", "data.kind=prompts",
              "data.path={tmp}/p.jsonl", "data.seq_len=64", "data.micro_batch_size=2",
              "train.max_steps=1", "optim.warmup_steps=0", "train.device=cpu"]
PROMPTS = [*ON_PROMPTS, "rl.max_completion_length=8", "rl.num_generations=2"]
GOOD_PROMPTS = write("p.jsonl", "".join('{"prompt": "say %d", "answer": "%d"}\n' % (i, i)
                                        for i in range(8)))

TABLE = [
    # ------------------------------------------- rl.* with another objective, and back
    Bad("an rl key with the next-token objective", ["train", "--dry-run", RUN, "rl.beta=0.1"],
        r"^rl\.beta: next_token does not use it \(it applies to train\.objective=grpo\)$"),
    Bad("an rl key with dpo", ["train", "--dry-run", RUN, *PAIRS, "rl.num_generations=4"],
        r"^rl\.num_generations: dpo does not use it \(it applies to train\.objective=grpo\)$"),
    Bad("an rl key in a YAML file with orpo",
        ["train", "--dry-run", "{tmp}/c.yaml", RUN],
        r"^rl\.loss_type: orpo does not use it",
        setup=write("c.yaml", "data: {kind: preference, path: p.jsonl}\n"
                              "train: {objective: orpo}\nrl: {loss_type: grpo}\n")),
    Bad("a preference key with grpo", [*EXACT, "train.beta=0.3"],
        r"^train\.beta: grpo does not use it \(it applies to dpo, ipo, simpo\)$"),
    Bad("a format pattern without the format reward", [*EXACT, "rl.format_pattern=x"],
        r"^rl\.format_pattern: rl\.rewards=exact_answer does not use it \(it applies to the "
        r"format reward\)$"),
    Bad("a chunked loss with grpo", [*EXACT, "train.loss_chunk_tokens=1024"],
        r"^train\.loss_chunk_tokens: train\.objective=grpo does not use it \(it applies to "
        r"the next-token and preference objectives\)$"),
    Bad("an answer field without exact_answer", [*GRPO, "rl.rewards=length",
                                                 "rl.answer_field=solution"],
        r"^rl\.answer_field: rl\.rewards=length does not use it"),
    # ---------------------------------------------------------------------- rewards
    Bad("grpo without rewards", GRPO, r"^rl\.rewards: required with train\.objective=grpo"),
    Bad("a reward file that does not exist", [*GRPO, "rl.rewards={tmp}/missing.py:f"],
        r"^rl\.rewards: .*missing\.py: no such file \(from '.*missing\.py:f'\)$"),
    Bad("a reward that is neither a built-in nor file:function", [*GRPO, "rl.rewards=exact"],
        r"^rl\.rewards: 'exact' is neither a built-in reward \(exact_answer, format, "
        r"length\) nor path/to/file\.py:function$"),
    Bad("a reward file without its function name", [*GRPO, "rl.rewards={tmp}/r.py"],
        r"^rl\.rewards: '.*r\.py' is neither a built-in reward", setup=REWARD_FILE),
    Bad("rewards that are a mapping", ["train", "--dry-run", "{tmp}/c.yaml", RUN],
        r"^rl\.rewards: \{'exact_answer': 1\} is not a list of rewards$",
        setup=write("c.yaml", "train: {objective: grpo}\nrl: {rewards: {exact_answer: 1}}\n")),
    Bad("fewer weights than rewards", [*GRPO, "rl.rewards=exact_answer,length",
                                       "rl.reward_weights=1"],
        r"^rl\.reward_weights: 1 weights for 2 rewards \(rl\.rewards\); give one per reward$"),
    Bad("a weight that is not a number", [*EXACT, "rl.reward_weights=heavy"],
        r"^rl\.reward_weights: 'heavy' is not a list of numbers$"),
    Bad("a weight that is not finite", [*EXACT, "rl.reward_weights=nan"],
        r"^rl\.reward_weights: nan is not a finite number$"),
    Bad("the format reward without a pattern", [*GRPO, "rl.rewards=format"],
        r"^rl\.format_pattern: the format reward needs a regular expression"),
    Bad("a format pattern that is not a regular expression",
        [*GRPO, "rl.rewards=format", "rl.format_pattern=(unclosed"],
        r"^rl\.format_pattern: '\(unclosed' is not a regular expression \(missing \), "),
    # ------------------------------------------------------------- the other keys
    Bad("a group of one completion (every advantage 0)", [*EXACT, "rl.num_generations=1"],
        r"^rl\.num_generations: must be >= 2, got 1$"),
    Bad("a completion as long as the sequence", [*EXACT, "data.seq_len=128"],
        r"^rl\.max_completion_length: 128 leaves no room for a prompt in data\.seq_len=128$"),
    Bad("an unknown loss type", [*EXACT, "rl.loss_type=bnpo"],
        r"^rl\.loss_type: 'bnpo' is not one of grpo, dr_grpo, dapo$"),
    Bad("an unknown reward scaling", [*EXACT, "rl.scale_rewards=std"],
        r"^rl\.scale_rewards: 'std' is not one of group, batch, none$"),
    Bad("a top_p of 0", [*EXACT, "rl.top_p=0"], r"^rl\.top_p: must be in \(0, 1\], got 0"),
    Bad("a temperature of 0", [*EXACT, "rl.temperature=0"],
        r"^rl\.temperature: must be >= 0\.01, got 0"),
    Bad("a temperature under the sampling floor", [*EXACT, "rl.temperature=0.001"],
        r"^rl\.temperature: must be >= 0\.01, got 0\.001$"),
    Bad("an epsilon of 1", [*EXACT, "rl.epsilon=1"], r"^rl\.epsilon: must be in \[0, 1\), got 1"),
    Bad("zero iterations per rollout", [*EXACT, "rl.num_iterations=0"],
        r"^rl\.num_iterations: must be >= 1, got 0$"),
    # ----------------------------------------------------- what grpo needs elsewhere
    Bad("grpo in a pipeline", [*EXACT, "parallel.pp=2"],
        r"^parallel\.pp: GRPO samples with the whole model on each rank"),
    Bad("grpo on chat samples", [*EXACT, "data.kind=sft", "data.path={chat}"],
        r"^train\.objective: grpo samples completions of prompts; it needs "
        r"data\.kind=prompts \(data\.kind is sft\)"),
    Bad("grpo on the demo corpus", EXACT,
        r"^train\.objective: grpo samples completions of prompts; it needs "
        r"data\.kind=prompts \(data\.kind is stdlib\)"),
    Bad("prompts with a preference objective", [*ON_PROMPTS, "train.objective=dpo"],
        r"^train\.objective: dpo compares chosen and rejected completions; it needs "
        r"data\.kind=preference \(data\.kind is prompts\)$", setup=GOOD_PROMPTS),
    Bad("prompts with the next-token objective", [*ON_PROMPTS, "train.objective=next_token"],
        r"^train\.objective: next_token does not train on prompts alone \(data\.kind=prompts\); "
        r"use grpo \(or auto\)$", setup=GOOD_PROMPTS),
    Bad("a checkpoint inside a reused rollout", [*PROMPTS, "rl.rewards=exact_answer",
                                                 "rl.num_iterations=2",
                                                 "train.checkpoint_every=3"],
        r"^train\.checkpoint_every: 3 is not a multiple of rl\.num_iterations=2 \(a "
        r"checkpoint falls after a rollout's last step: a rollout is not saved\)$",
        setup=GOOD_PROMPTS),
    Bad("a stop inside a reused rollout", [*PROMPTS, "rl.rewards=exact_answer",
                                           "rl.num_iterations=3", "train.stop_at_step=4"],
        r"^train\.stop_at_step: 4 is not a multiple of rl\.num_iterations=3 ",
        setup=GOOD_PROMPTS),
    # ---------------------------------------------------------------- the prompts file
    Bad("a prompts file with a bad line", [*PROMPTS, "rl.rewards=exact_answer"],
        r"^.*p\.jsonl:2: ", setup=write("p.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n')),
    Bad("a prompt record without a prompt", [*PROMPTS, "rl.rewards=exact_answer"],
        r"^.*p\.jsonl:2: the record has no 'prompt'$",
        setup=write("p.jsonl", '{"prompt": "a"}\n{"question": "b"}\n')),
    Bad("a record field named like a reward's argument", [*PROMPTS, "rl.rewards=exact_answer"],
        r"^.*p\.jsonl:2: the field 'completions' has the name of an argument every reward "
        r"takes \(prompts, completions, completion_ids\); rename it$",
        setup=write("p.jsonl", '{"prompt": "a"}\n{"prompt": "b", "completions": []}\n')),
    Bad("an answer field no record holds (a typo)", [*PROMPTS, "rl.rewards=exact_answer",
                                                     "rl.answer_field=anwser"],
        r"^rl\.answer_field: no record of .*p\.jsonl has the field 'anwser' that the "
        r"exact_answer reward reads \(its records have: answer\)$", setup=GOOD_PROMPTS),
    Bad("a prompts file that does not exist", [*PROMPTS, "rl.rewards=exact_answer"],
        r"^data\.path: .*p\.jsonl: no such file \(prompts are JSON Lines\)$"),
    Bad("a prompt longer than the context", [*PROMPTS, "rl.rewards=length",
                                            "data.seq_len=64", "rl.max_completion_length=16"],
        r"^.*p\.jsonl:3: the prompt has \d+ tokens; data\.seq_len - rl\.max_completion_length "
        r"leaves 48$",
        setup=write("p.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "'
                    + "line of a small corpus " * 20 + '"}\n')),
    Bad("a reward function with the wrong signature", [*PROMPTS, "rl.rewards={tmp}/r.py:f"],
        r"^rl\.rewards: '.*r\.py:f' takes \(completions\); a reward takes \(prompts, "
        r"completions, \*\*kwargs\) as in TRL$",
        setup=steps(GOOD_PROMPTS, write("r.py", "def f(completions):\n    return []\n"))),
    Bad("a reward file that fails as it loads", [*PROMPTS, "rl.rewards={tmp}/r.py:f"],
        r"^rl\.rewards: loading .*r\.py failed: ImportError: no such module$",
        setup=steps(GOOD_PROMPTS, write("r.py", "raise ImportError('no such module')\n"))),
    Bad("a reward file that exits as it loads", [*PROMPTS, "rl.rewards={tmp}/r.py:f"],
        r"^rl\.rewards: loading .*r\.py failed: SystemExit: 0$",
        setup=steps(GOOD_PROMPTS, write("r.py", "import sys\nsys.exit(0)\n"))),
]


@pytest.mark.parametrize("row", params(TABLE))
def test_rl_input_is_refused_in_one_line(row, bad_input_assets, tmp_path, capsys,
                                         monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    check_refused(row, bad_input_assets, tmp_path, capsys)


# ------------------------------------------ a resume that changes what GRPO's loss reads
# (as train.beta for DPO: tests/integration/test_bad_inputs_resume.py)
GRPO_RUN = [*PROMPTS, "rl.rewards=exact_answer", "data.path={prompts}", "train.max_steps=2",
            "train.save=false", "train.checkpoint_every=2", "data.eval_fraction=0"]


def _grpo_run(tmp: Path, assets: dict) -> None:
    shutil.copytree(assets["grpo_run"], tmp / "run", symlinks=True)


def _changed(key: str, before: str, now: str) -> str:
    return rf"^train\.resume: .*{key} is {before} in the checkpoint step-0000002 but {now} now"


RESUME_TABLE = [
    Bad("resume grpo with another beta", [*GRPO_RUN, "rl.beta=0.1", "train.resume=auto"],
        _changed(r"rl\.beta", r"0\.0", r"0\.1"), setup=_grpo_run),
    Bad("resume grpo with another temperature",
        [*GRPO_RUN, "rl.temperature=0.5", "train.resume=auto"],
        _changed(r"rl\.temperature", r"1\.0", r"0\.5"), setup=_grpo_run),
    Bad("resume grpo with other rewards", [*GRPO_RUN, "rl.rewards=length", "train.resume=auto"],
        _changed(r"rl\.rewards", r"\[exact_answer\]", r"\[length\]"), setup=_grpo_run),
    Bad("resume grpo masking truncated completions",
        [*GRPO_RUN, "rl.mask_truncated_completions=true", "train.resume=auto"],
        _changed(r"rl\.mask_truncated_completions", "false", "true"), setup=_grpo_run),
]


@pytest.fixture(scope="module")
def grpo_run(bad_input_assets, tmp_path_factory) -> dict:
    """The shared assets plus ``grpo_run`` (2 GRPO steps, checkpointed at step 2) and
    ``{prompts}``, its prompts."""
    from lmforge.cli import main

    root = tmp_path_factory.mktemp("grpo-run")
    prompts = root / "p.jsonl"
    prompts.write_text("".join('{"prompt": "say %d", "answer": "%d"}\n' % (i, i)
                               for i in range(8)))
    assets = {**bad_input_assets, "prompts": prompts, "grpo_run": root / "run"}
    argv = [a.format(tmp=root, model=assets["model"], prompts=prompts) for a in GRPO_RUN]
    assert main(argv) == 0
    return assets


@pytest.mark.parametrize("row", params(RESUME_TABLE))
def test_a_grpo_resume_that_changes_its_loss_sampling_or_rewards_is_refused(
        row, grpo_run, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    capsys.readouterr()  # (the fixture's training output)
    check_refused(row, grpo_run, tmp_path, capsys)


@pytest.mark.parametrize("body,message", [
    ("return [1.0]", r"reward flaky: returned 1 values for 4 completions \(one float or None "
                     r"per completion\)"),
    ("return [float('nan')] * len(completions)",
     r"reward flaky: nan is not a finite number or None \(for completion 0, prompt 'say "),
    ("raise KeyError('tests')", r"reward flaky: raised KeyError: 'tests' \(for completion 0, "
                                r"prompt 'say "),
    ("raise SystemExit(0)", r"reward flaky: raised SystemExit: 0 \(for completion 0, prompt "),
    ("raise BaseException('odd')", r"reward flaky: raised BaseException: odd \(for "),
    ("return {i: 1.0 for i in range(len(completions))}",
     r"reward flaky: returned \{0: 1\.0, 1: 1\.0, 2: 1\.0, 3: 1\.0\}, not a list"),
    ("return [10 ** 400] * len(completions)",
     r"reward flaky: an integer of 401 digits is not a finite number or None \(for "),
    ("return [10 ** 5000] * len(completions)",
     r"reward flaky: an integer of more than 4300 digits is not a finite number or None"),
])
def test_a_reward_that_fails_mid_run_stops_it_in_one_line_and_the_checkpoint_stays(
        bad_input_assets, tmp_path, capsys, monkeypatch, body, message):
    """Step 1 scores, step 2's reward fails (raises, exits, or returns what is not a list
    of finite numbers): exit 2, one line naming the function and the record, and step
    1's checkpoint is still there."""
    from lmforge.cli import main

    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    (tmp_path / "p.jsonl").write_text("".join('{"prompt": "say %d", "answer": "%d"}\n' % (i, i)
                                              for i in range(8)))
    (tmp_path / "r.py").write_text(
        "calls = []\n"
        "def flaky(prompts, completions, **kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 1:\n"
        f"        {body}\n"
        "    return [0.0] * len(completions)\n")
    argv = [a.format(tmp=tmp_path, model=bad_input_assets["model"]) for a in PROMPTS]
    code = main([*argv, f"rl.rewards={tmp_path}/r.py:flaky", "train.max_steps=3",
                 "train.checkpoint_every=1", "train.eval_every=0", "data.eval_fraction=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("lmforge: error: ") and __import__("re").search(message, err[-1])
    assert (tmp_path / "run" / "checkpoints" / "step-0000001").is_dir()
