"""The rl section (GRPO): its keys carry TRL's GRPOConfig names, each is declared once with
its help, a recipe that uses them on prompts is accepted (elsewhere refused), and the
ones a run does not read are refused (the refusals themselves: the bad-input table,
tests/integration/test_bad_inputs_rl.py)."""
from __future__ import annotations

import dataclasses

import pytest

from lmforge.config import ConfigError, JobConfig, describe_keys, load_config, objective_name
from lmforge.config.schema import RLConfig

OURS_ONLY = {"rewards", "answer_field", "format_pattern"}  # (TRL: reward_funcs, code)


def test_every_rl_key_but_the_reward_choice_is_a_trl_grpo_config_field():
    trl = pytest.importorskip("trl")
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    ours = {f.name for f in dataclasses.fields(RLConfig)}
    assert ours - OURS_ONLY <= theirs, sorted(ours - OURS_ONLY - theirs)
    defaults = trl.GRPOConfig.__dataclass_fields__
    for name in ("beta", "epsilon", "epsilon_high", "num_iterations", "scale_rewards",
                 "loss_type", "mask_truncated_completions", "temperature", "top_p",
                 "num_generations"):
        assert getattr(RLConfig(), name) == defaults[name].default, name


def test_every_rl_key_is_listed_with_its_help():
    text = describe_keys(JobConfig())
    for f in dataclasses.fields(RLConfig):
        assert f"  rl.{f.name} (default" in text
        assert f.metadata["help"]


def test_a_grpo_recipe_on_prompts_is_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("def r(prompts, completions, **kw):\n    return []\n")
    keys = ["rl.rewards=exact_answer,format,mine.py:r", "rl.reward_weights=[1, 0.5, 2]",
            "rl.format_pattern=<a>.*</a>", "rl.answer_field=solution", "rl.beta=0.04",
            "rl.loss_type=dr_grpo"]
    cfg = load_config(None, ["data.kind=prompts", "data.path=p.jsonl", *keys]).validate()
    assert cfg.rl.beta == 0.04 and cfg.rl.loss_type == "dr_grpo"
    assert objective_name(cfg) == "grpo"  # (auto, for prompts)
    with pytest.raises(ConfigError, match=r"^train\.objective: grpo .* needs data\.kind=prompts "
                                          r"\(data\.kind is stdlib\)$"):
        load_config(None, ["train.objective=grpo", *keys]).validate()
    # two processes (FSDP2) sample as one; a pipeline or cp cannot (their own line)
    load_config(None, ["data.kind=prompts", "data.path=p.jsonl", *keys]).validate(2)
    with pytest.raises(ConfigError, match=r"^parallel\.pp: GRPO samples with the whole model"):
        load_config(None, ["data.kind=prompts", "data.path=p.jsonl", "parallel.pp=2",
                           *keys]).validate(2)


def test_the_estimate_counts_a_rollouts_completions_and_its_reference():
    """A GRPO micro-batch of prompts trains as prompts x rl.num_generations rows (and its
    KV cache holds as many); rl.beta > 0 adds the reference's pass (LoRA) or copy."""
    from lmforge.perf.estimate_setup import setup_from_config

    base = ["data.kind=prompts", "data.path=p.jsonl", "rl.rewards=exact_answer",
            "data.micro_batch_size=4", "rl.num_generations=6"]
    setup = setup_from_config(load_config(None, base), device="cpu", world_size=1)
    assert setup.micro_batch == 24 and setup.reference == ""
    full = setup_from_config(load_config(None, [*base, "rl.beta=0.04"]), device="cpu",
                             world_size=1)
    lora = setup_from_config(load_config(None, [*base, "rl.beta=0.04", "lora.enabled=true"]),
                             device="cpu", world_size=1)
    assert (full.reference, lora.reference) == ("copy", "pass")
