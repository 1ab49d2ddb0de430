"""GRPO's rewards (train/rewards.py): the built-ins' answers, format and length, user
functions loaded from their file with TRL's signature, the weighted NaN-aware sum, and the
refusals that name the function and the record."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from lmforge.config.errors import ConfigError
from lmforge.train.rewards import (Reward, RewardError, extract_answer, load_rewards,
                                   normalize_answer, score, weighted_sum)


@pytest.mark.parametrize("text,answer", [
    ("so the sum is \\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{ 4 }", "4"),
    ("work 12 + 30\n#### 42\nmore text 9", "42"),
    ("I think 3 apples, then 1,250.5 pears", "1,250.5"),
    ("no number here", None),
    ("an unclosed \\boxed{12 then 5", "5"),
])
def test_the_final_answer_is_boxed_then_after_hashes_then_the_last_number(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("a,b", [("1,000", "1000"), ("2.50", "2.5"), ("1/2", "0.5"),
                                 ("$12", "12."), ("-3", "-3.0"), (7, "7"), (0.5, "1/2"),
                                 ("\\frac{1}{2}", "0.5"), ("\\dfrac{-3}{4}", "-0.75")])
def test_numbers_compare_by_value(a, b):
    assert normalize_answer(a) == normalize_answer(b)
    assert isinstance(normalize_answer(a), Fraction)


def test_text_answers_compare_with_whitespace_collapsed_and_case_kept():
    assert normalize_answer("New  York") == normalize_answer(" New York ")
    assert normalize_answer("yes") != normalize_answer("Yes")
    assert normalize_answer("1/0") == "1/0"


def _one(reward_list, completions, **fields):
    prompts = [f"p{i}" for i in range(len(completions))]
    ids = [[1] * len(c) for c in completions]
    return score(reward_list, prompts, completions, ids, fields)[:, 0].tolist()


def test_exact_answer_reads_the_records_answer_field_and_skips_a_record_without_it():
    rewards = load_rewards(["exact_answer"], answer_field="solution")
    got = _one(rewards, ["#### 1,000", "\\boxed{0.5}", "it is 3", "x 4"],
               solution=["1000", "1/2", 4, None])
    assert got[:3] == [1.0, 1.0, 0.0] and math.isnan(got[3])
    assert rewards[0].name == "exact_answer"


def test_an_expected_answer_that_is_a_worked_solution_is_read_for_its_final_answer():
    rewards = load_rewards(["exact_answer"])
    got = _one(rewards, ["so 72", "\\boxed{3/4}", "so 71"],
               answer=["48 + 24 = 72\n#### 72", "it is \\boxed{0.75}", "#### 72"])
    assert got == [1.0, 1.0, 0.0]


def test_numpy_scalars_are_numbers_as_in_trl():
    np = pytest.importorskip("numpy")
    rewards = load_rewards(["exact_answer"])
    rewards[0] = type(rewards[0])("np", lambda prompts, completions, **kw:
                                  [np.float32(0.5), np.int64(2)], 1.0)
    assert score(rewards, ["a", "b"], ["x", "y"], [[1], [2]], {})[:, 0].tolist() == [0.5, 2.0]


def test_exact_answer_reads_chat_completions_as_trl_passes_them():
    rewards = load_rewards(["exact_answer"])
    chat = [[{"role": "assistant", "content": "the answer is 12"}]]
    assert _one(rewards, chat, answer=["12"]) == [1.0]


def test_the_format_reward_is_a_full_match_across_lines():
    rewards = load_rewards(["format"], format_pattern=r"<think>.*</think>\s*<answer>.*</answer>")
    got = _one(rewards, ["<think>a\nb</think>\n<answer>3</answer>",
                         "<think>a</think><answer>3</answer> trailing",
                         "before <think>a</think><answer>3</answer>"])
    assert got == [1.0, 0.0, 0.0]
    assert rewards[0].name == "format"


def test_the_length_penalty_is_minus_tokens_over_the_completion_limit():
    rewards = load_rewards(["length"], max_completion_length=8)
    assert _one(rewards, ["", "abcd", "abcdefgh"]) == [0.0, -0.5, -1.0]


def test_a_user_function_with_trls_signature_gets_the_record_fields(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def has_tests(prompts, completions, completion_ids, tests, **kwargs):\n"
        "    return [None if t is None else float(len(c) > t) for c, t in zip(completions, tests)]\n")
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards(["my_rewards.py:has_tests"])
    got = _one(rewards, ["abc", "a", "z"], tests=[2, 2, None])
    assert got[:2] == [1.0, 0.0] and math.isnan(got[2])
    assert rewards[0].name == "has_tests"


def test_several_rewards_are_summed_with_weights_leaving_out_none():
    per_reward = torch.tensor([[1.0, 0.5], [math.nan, 2.0], [math.nan, math.nan]])
    total = weighted_sum(per_reward, torch.tensor([2.0, -1.0]))
    assert total[:2].tolist() == [1.5, -2.0] and math.isnan(total[2])


@pytest.mark.parametrize("spec,source,match", [
    ("missing.py:f", None, r"rl.rewards: missing.py: no such file"),
    ("r.py:absent", "def f(prompts, completions, **kw): return []\n", r"defines no function 'absent'"),
    ("r.py:f", "def f(completions): return []\n", r"takes \(completions\); a reward takes"),
    ("r.py:f", "def f(prompts, completions): return []\n", r"a reward takes \(prompts, completions, \*\*kwargs\)"),
    ("r.py:f", "raise RuntimeError('boom')\n", r"loading r.py failed: RuntimeError: boom"),
    ("r.py", None, r"neither a built-in reward"),
    ("exact", None, r"neither a built-in reward"),
])
def test_a_reward_that_cannot_load_is_a_config_error_naming_rl_rewards(tmp_path, monkeypatch,
                                                                       spec, source, match):
    monkeypatch.chdir(tmp_path)
    if source is not None:
        (tmp_path / "r.py").write_text(source)
    with pytest.raises(ConfigError, match=match):
        load_rewards([spec])


def test_reward_settings_are_checked():
    with pytest.raises(ConfigError, match=r"rl.reward_weights: 1 weights for 2 rewards"):
        load_rewards(["length", "length"], [1.0])
    with pytest.raises(ConfigError, match=r"rl.format_pattern: the format reward needs"):
        load_rewards(["format"])
    with pytest.raises(ConfigError, match=r"rl.format_pattern: '\(' is not a regular"):
        load_rewards(["format"], format_pattern="(")


@pytest.mark.parametrize("body,match", [
    ("raise KeyError('answer')", r"reward bad: raised KeyError: 'answer' \(for completion 0, prompt 'What is 2\+2"),
    ("return [1.0 / (c != 'x') for c in completions]", r"reward bad: raised ZeroDivisionError: float division by zero \(for completion 1, prompt 'Name the capital'\)$"),
    ("return [1.0]", r"reward bad: returned 1 values for 2 completions"),
    ("return [1.0, float('nan')]", r"reward bad: nan is not a finite number or None \(for completion 1, prompt 'Name the"),
    ("return [1.0, float('inf')]", r"reward bad: inf is not a finite number"),
    ("return [1.0, 'high']", r"reward bad: 'high' is not a finite number"),
    ("return 3.0", r"reward bad: returned 3.0, not a list"),
])
def test_a_reward_that_fails_names_the_function_and_the_record(tmp_path, monkeypatch, body,
                                                               match):
    """A raise names the first record that raises alone (the batch is called again one
    completion at a time)."""
    (tmp_path / "r.py").write_text(f"def bad(prompts, completions, **kw):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards(["r.py:bad"])
    with pytest.raises(RewardError, match=match):
        score(rewards, ["What is 2+2? Think step by step.", "Name the capital"], ["4", "x"],
              [[1], [2]], {})


def test_a_reward_that_raises_only_on_the_whole_batch_names_the_batch(tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text("def pair(prompts, completions, **kw):\n"
                                   "    assert len(completions) == 1, 'one at a time'\n"
                                   "    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=r"reward pair: raised AssertionError: one at a "
                                          r"time \(on the batch of 2 starting at completion "
                                          r"0, prompt 'p0'\)$"):
        score(load_rewards(["r.py:pair"]), ["p0", "p1"], ["a", "b"], [[1], [2]], {})


def test_a_reward_file_is_executed_once_a_process(tmp_path, monkeypatch):
    """The policy and its frozen reference copy both build the objective: the user's file
    runs once (its module state, a counter here, is kept)."""
    (tmp_path / "r.py").write_text("loads = []\nloads.append(1)\n"
                                   "def f(prompts, completions, **kw):\n"
                                   "    return [float(len(loads))] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    first, second = load_rewards(["r.py:f"])[0], load_rewards(["r.py:f"])[0]
    assert first.func is second.func
    assert _one([second], ["a"]) == [1.0]


# ------------------------------------------------ what a reward can and cannot reach
MUTATE = ("def mutate(prompts, completions, completion_ids, answer, **kw):\n"
          "    prompts[0][0]['content'] = 'changed'\n    prompts.append('extra')\n"
          "    completions[0] = 'changed'\n    completion_ids[0].append(99)\n"
          "    answer[0].append('changed')\n    return [0.0] * len(completions)\n"
          "seen = []\n"
          "def look(prompts, completions, completion_ids, answer, **kw):\n"
          "    seen.append((prompts, completions, completion_ids, answer))\n"
          "    return [0.0] * len(completions)\n")


def test_each_reward_gets_copies_so_none_changes_what_the_next_reward_or_the_caller_sees(
        tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text(MUTATE)
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards(["r.py:mutate", "r.py:look"])
    prompts = [[{"role": "user", "content": "hi"}], "text"]
    completions, ids, answer = ["a", "b"], [[1, 2], [3]], [["4"], ["5"]]
    score(rewards, prompts, completions, ids, {"answer": answer})
    assert prompts == [[{"role": "user", "content": "hi"}], "text"]
    assert (completions, ids, answer) == (["a", "b"], [[1, 2], [3]], [["4"], ["5"]])
    seen = rewards[1].func.__globals__["seen"]
    assert seen == [([[{"role": "user", "content": "hi"}], "text"], ["a", "b"],
                     [[1, 2], [3]], [["4"], ["5"]])]


@pytest.mark.parametrize("body,match", [
    ("raise SystemExit(0)", r"reward bad: raised SystemExit: 0 \(for completion 0, "),
    ("import sys; sys.exit('bye')", r"reward bad: raised SystemExit: bye \(for completion 0"),
    ("raise GeneratorExit()", r"reward bad: raised GeneratorExit"),
])
def test_a_reward_that_exits_is_a_reward_error_naming_it(tmp_path, monkeypatch, body, match):
    (tmp_path / "r.py").write_text(f"def bad(prompts, completions, **kw):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=match):
        score(load_rewards(["r.py:bad"]), ["p0", "p1"], ["a", "b"], [[1], [2]], {})


def test_a_keyboard_interrupt_in_a_reward_stays_an_interrupt(tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text("def f(prompts, completions, **kw):\n"
                                   "    raise KeyboardInterrupt\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        score(load_rewards(["r.py:f"]), ["p0"], ["a"], [[1]], {})


@pytest.mark.parametrize("source,match", [
    ("raise SystemExit(4)\n", r"rl.rewards: loading r.py failed: SystemExit: 4$"),
    ("import sys\nsys.exit()\n", r"rl.rewards: loading r.py failed: SystemExit$"),
])
def test_a_reward_file_that_exits_as_it_loads_is_a_config_error(tmp_path, monkeypatch, source,
                                                                match):
    (tmp_path / "r.py").write_text(source + "def f(prompts, completions, **kw): return []\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=match):
        load_rewards(["r.py:f"])


def test_a_keyboard_interrupt_while_a_reward_file_loads_stays_an_interrupt(tmp_path,
                                                                           monkeypatch):
    (tmp_path / "r.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        load_rewards(["r.py:f"])


# ------------------------------------------------------------ what a reward returns
@pytest.mark.parametrize("body,match", [
    ("return {0: 1.0, 1: 1.0}", r"reward bad: returned \{0: 1\.0, 1: 1\.0\}, not a list"),
    ("return 'ab'", r"reward bad: returned 'ab', not a list"),
    ("return {1.0, 2.0}", r"reward bad: returned \{1\.0, 2\.0\}, not a list"),
    ("return [{'score': 1.0}, 1.0]", r"reward bad: \{'score': 1\.0\} is not a finite number"),
    ("return [10 ** 400, 1.0]", r"reward bad: an integer of 401 digits is not a finite "
                                r"number or None \(for completion 0, prompt 'p0'\)$"),
    ("return [10 ** 5000, 1.0]", r"reward bad: an integer of more than 4300 digits is not a "
                                 r"finite number or None \(for completion 0, prompt 'p0'\)$"),
])
def test_a_reward_that_returns_no_list_of_numbers_is_refused_in_one_line(
        tmp_path, monkeypatch, body, match):
    (tmp_path / "r.py").write_text(f"def bad(prompts, completions, **kw):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=match):
        score(load_rewards(["r.py:bad"]), ["p0", "p1"], ["a", "b"], [[1], [2]], {})


def _constant(value, name="big"):
    def reward(prompts, completions, **kw):
        return [value] * len(completions)
    reward.__name__ = name
    return reward


def test_rewards_beyond_float32_are_kept_in_float64():
    rewards = [Reward("big", _constant(1e39), 1.0), Reward("heavy", _constant(1.0), 1e39)]
    table = score(rewards, ["p0"], ["a"], [[1]], {})
    assert table.dtype == torch.float64 and table[0].tolist() == [1e39, 1.0]
    assert weighted_sum(table, torch.tensor([1.0, 1e39], dtype=torch.float64)).tolist() \
        == [2e39]


@pytest.mark.parametrize("values,weights,match", [
    ((1e200, 1.0), (1e200, 1.0), r"reward big: 1e\+200 x its weight 1e\+200 "
                                 r"\(rl\.reward_weights\) makes the weighted reward not "
                                 r"finite \(for completion 0, prompt 'p0'\)$"),
    ((1e308, 1e308), (1.0, 1.0), r"reward small: 1e\+308 x its weight 1\.0 "
                                 r"\(rl\.reward_weights\) makes the weighted reward not "
                                 r"finite"),
])
def test_a_weighted_sum_that_is_not_finite_is_refused_naming_the_reward(values, weights,
                                                                       match):
    rewards = [Reward("big", _constant(values[0]), weights[0]),
               Reward("small", _constant(values[1], "small"), weights[1])]
    with pytest.raises(RewardError, match=match):
        score(rewards, ["p0", "p1"], ["a", "b"], [[1], [2]], {})


def test_two_rewards_of_one_name_keep_separate_metrics(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("def reward(prompts, completions, **kw):\n"
                                   "    return [1.0] * len(completions)\n")
    (tmp_path / "b.py").write_text("def reward(prompts, completions, **kw):\n"
                                   "    return [2.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards(["a.py:reward", "b.py:reward", "length", "length"])
    assert [r.name for r in rewards] == ["reward", "reward_2", "length", "length_2"]
