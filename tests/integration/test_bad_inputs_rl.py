"""Bad-input table of GRPO's configuration (issue 39): the rl section's keys, its rewards
and what it needs of the rest of the config, each refused in one line naming the key at
fault, before any model is built or a reward file is executed. (A reward that fails at
run time: tests/unit/train/test_rewards.py.) The harness: tests/helpers/bad_inputs.py."""
from __future__ import annotations

import pytest

from helpers.bad_inputs import Bad, check_refused, params, write

RUN = "train.output_dir={tmp}/run"
GRPO = ["train", "--dry-run", RUN, "train.objective=grpo"]
EXACT = [*GRPO, "rl.rewards=exact_answer"]
PAIRS = ["data.kind=preference", "data.path={chat}"]
REWARD_FILE = write("r.py", "def f(prompts, completions, **kwargs):\n    return []\n")

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
        r"^rl\.temperature: must be > 0, got 0"),
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
]


@pytest.mark.parametrize("row", params(TABLE))
def test_rl_input_is_refused_in_one_line(row, bad_input_assets, tmp_path, capsys,
                                         monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    check_refused(row, bad_input_assets, tmp_path, capsys)
