"""Config hygiene: a quoted value never runs long (``show``), a YAML document cannot
expand without bound through its aliases, a mapping's keys are checked like any key's,
and a setting the run would ignore is refused, each rule checked against the code that
reads the keys."""
import dataclasses

import pytest
import torch

from lmforge.config import ConfigError, load_config, read_yaml_file
from lmforge.config.errors import naming, show
from lmforge.config.keys import OBJECTIVE_KEYS, PREFERENCE_OBJECTIVES
from lmforge.config.loading import MAX_YAML_VALUES, safe_load
from lmforge.config.schema import ROPE_SCALING_KEYS, rope_scaling_problem
from lmforge.models.llama import hf as llama_hf
from lmforge.models.llama.model import RopeScaling
from lmforge.models.preference import (NEEDS_REFERENCE, PairLogps, PreferenceParams,
                                       preference_loss)


# ---------------------------------------------------------------------------- show

@pytest.mark.parametrize("value", [
    "x" * 10_000, list(range(10_000)), [[["a"] * 50] * 50] * 50, {str(i): i for i in range(999)},
    10 ** 4000, "line one\nline two " * 100])
def test_show_quotes_any_value_in_one_short_line(value):
    text = show(value)
    assert len(text) <= 80 and "\n" not in text


def test_show_gives_a_short_value_whole():
    assert show([1, "a"]) == "[1, 'a']" and show("cuda:0") == "'cuda:0'"


# --------------------------------------------------------------------- YAML aliases

def bomb(levels: int, width: int = 9) -> str:
    items = ['&a [' + ", ".join(['"lol"'] * width) + ']']
    for i in range(1, levels):
        items.append(f"&{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * width) + "]")
    return "[" + ", ".join(items) + "]"


def test_an_alias_bomb_is_refused_naming_the_line_before_it_is_built(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text("train:\n  seed: 1\nmodel:\n  preset: " + bomb(9) + "\n")
    with pytest.raises(ConfigError, match=rf"^{path}:4: YAML aliases here expand to more "
                                          rf"than {MAX_YAML_VALUES:,} values"):
        read_yaml_file(path)


def test_aliases_that_stay_small_and_merge_keys_still_load():
    text = "base: &base {lr: 1, steps: 2}\nrun: {<<: *base, steps: 3}\nlists: " + bomb(3) + "\n"
    data = safe_load(text)
    assert data["run"] == {"lr": 1, "steps": 3} and len(data["lists"][2]) == 9


def test_an_alias_inside_what_it_names_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("a: 1\nb: &x {c: *x}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: a YAML alias refers to the list or "
                                          r"mapping that holds it"):
        read_yaml_file(path)


def test_yaml_nested_past_pythons_recursion_is_one_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not valid YAML \(nested deeper"):
        read_yaml_file(path)


# ------------------------------------------------------------ model.rope_scaling keys

def test_the_rope_scaling_keys_are_the_kinds_and_fields_the_llama_family_reads():
    assert tuple(ROPE_SCALING_KEYS) == llama_hf.ROPE_KINDS
    written = [RopeScaling(factor=2.0, kind="linear"),
               RopeScaling(8.0, 1.0, 4.0, 8192),
               RopeScaling(factor=4.0, original_max_position_embeddings=4096, kind="yarn",
                           attention_factor=1.1)]
    for scaling in written:  # what lmforge writes to config.json, it reads back
        mapping = llama_hf.rope_scaling_dict(scaling)
        assert rope_scaling_problem(mapping) is None, mapping
        assert set(mapping) - {"rope_type"} <= set(ROPE_SCALING_KEYS[scaling.kind])


@pytest.mark.parametrize("mapping, key", [
    ({"rope_type": "linear", "factor": 2, "low_freq_factor": 1}, "low_freq_factor"),
    ({"factor": 2}, "factor"),  # no type: transformers' default, which reads no factor
    ({"rope_type": ["yarn"]}, "rope_type"),
    ({"type": "yarn", "factor": 2, 7: 1}, 7),
])
def test_a_rope_scaling_key_the_kind_does_not_read_is_named(mapping, key):
    assert rope_scaling_problem(mapping)[0] == key


# ------------------------------------------------------- settings the run would ignore

_PARAM = {"train.beta": "beta", "train.label_smoothing": "label_smoothing",
          "train.simpo_gamma": "gamma", "train.orpo_lambda": "lam"}


@pytest.mark.parametrize("objective", PREFERENCE_OBJECTIVES)
def test_each_objective_uses_exactly_the_keys_it_is_allowed(objective):
    """The table the refusal reads (OBJECTIVE_KEYS) against the losses themselves: a key
    an objective may not be given changes nothing of its loss, one it may does."""
    torch.manual_seed(0)
    policy = PairLogps(-torch.rand(4) * 9, -torch.rand(4) * 9, torch.full((4,), 5.0),
                       torch.full((4,), 6.0))
    reference = PairLogps(-torch.rand(4) * 9, -torch.rand(4) * 9, policy.chosen_tokens,
                          policy.rejected_tokens)
    base = PreferenceParams(beta=0.1, label_smoothing=0.1, gamma=0.5, lam=0.1)
    loss = preference_loss(objective, policy, reference, base)[0]
    for key, field in _PARAM.items():
        changed = dataclasses.replace(base, **{field: getattr(base, field) * 2})
        moved = not torch.equal(preference_loss(objective, policy, reference, changed)[0], loss)
        assert moved is (objective in OBJECTIVE_KEYS[key]), (key, objective)
    assert (objective in OBJECTIVE_KEYS["train.reference"]) is (objective in NEEDS_REFERENCE)


PAIRS = ["data.kind=preference", "data.path=pairs.jsonl"]


@pytest.mark.parametrize("overrides", [
    [*PAIRS, "train.objective=orpo", "train.label_smoothing=0.0"],  # the default: unset
    [*PAIRS, "train.objective=simpo", "train.reference=live"],
    ["lora.enabled=false", "lora.rank=16"],  # a LoRA recipe switched off on purpose
    ["parallel.pp=2", "parallel.pp_schedule=gpipe"],
])
def test_a_default_value_or_a_used_one_is_not_refused(overrides):
    load_config(None, overrides)


def test_a_recipe_setting_a_key_its_objective_ignores_is_refused_naming_it(tmp_path):
    path = tmp_path / "orpo.yaml"
    path.write_text("data: {kind: preference, path: p.jsonl}\n"
                    "train: {objective: orpo, label_smoothing: 0.1}\n")
    with pytest.raises(ConfigError, match=r"^train\.label_smoothing: orpo does not use it "
                                          r"\(it applies to dpo, simpo\)$"):
        load_config(path)


def test_the_estimate_may_vary_keys_that_leave_a_setting_idle():
    """validate() (what plan and the memory refusal call on their variations) does not
    apply the rule: full checkpointing of a selective config is a valid variation."""
    cfg = load_config(None, ["train.activation_checkpointing=selective",
                             "train.activation_checkpointing_every=3"])
    cfg.train.activation_checkpointing = "full"
    cfg.validate()


# ------------------------------------------------------------- no temporary path shown

def test_naming_puts_the_users_path_where_a_temporary_copys_would_be(tmp_path):
    copy = tmp_path / ".out.gguf-hf-x1y2" / "hf"
    with pytest.raises(ValueError, match=r"^run/step-1/config\.json: bad$"):
        with naming(copy, "run/step-1"):
            raise ValueError(f"{copy}/config.json: bad")
    with pytest.raises(FileNotFoundError, match=r"run/step-1/tokenizer\.json"):
        with naming(copy, "run/step-1"):
            (copy / "tokenizer.json").read_text()
    with pytest.raises(KeyError):  # not a user's error: untouched
        with naming(copy, "run/step-1"):
            raise KeyError(str(copy))
