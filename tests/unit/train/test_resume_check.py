"""What a resume may change (train/resume_check.py), on checkpoints written here as a run
writes their side files (meta.json's resolved model args, config.yaml): the model and the
objective are compared as resolved, the rest is announced. The refusals end to end, and
the run directory left as it was: tests/integration/test_bad_inputs_resume.py."""
import dataclasses
import json

import pytest
import yaml

from lmforge.config import ConfigError, load_config
from lmforge.job import resolve
from lmforge.train.resume_check import check_resume

BASE = ["model.vocab_size=512", "train.device=cpu"]


def _job(*overrides):
    return resolve(load_config(None, [*BASE, *overrides]))


def _checkpoint(tmp_path, job, model_args=True):
    """A checkpoint's side files as the run of ``job`` writes them."""
    path = tmp_path / "checkpoints" / "step-0000004"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text('{"step": 4}\n')
    meta = {"step": 4, "model_args": dataclasses.asdict(job.args) if model_args else None}
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "config.yaml").write_text(yaml.safe_dump(job.config.to_dict(), sort_keys=False))
    return path


def test_the_same_run_resumes_without_a_line(tmp_path):
    assert check_resume(_job(), _checkpoint(tmp_path, _job())) == []


def test_a_shape_spelled_another_way_is_the_same_model(tmp_path):
    """tiny, and the debug preset overridden field by field to tiny's shape (with the
    head size written out): the resolved models are equal."""
    path = _checkpoint(tmp_path, _job())
    same = _job("model.preset=debug", "model.dim=256", "model.n_layers=4", "model.n_heads=8",
                "model.n_kv_heads=4", "model.ffn_dim=688", "model.tie_embeddings=true",
                "model.head_dim=32", "model.max_seq_len=1024")
    assert check_resume(same, path) == []


def test_every_changed_model_key_is_named_with_both_values(tmp_path):
    path = _checkpoint(tmp_path, _job())
    with pytest.raises(ConfigError) as refused:
        check_resume(_job("model.n_layers=2", "model.rope_theta=500000"), path)
    message = str(refused.value)
    assert message.startswith("train.resume: model.n_layers is 4 in the checkpoint "
                              "step-0000004 but 2 now; model.rope_theta is 10000.0 in the "
                              "checkpoint step-0000004 but 500000.0 now; ")
    assert "\n" not in message


def test_the_vocabulary_waits_for_a_tokenizer_still_to_be_trained(tmp_path):
    path = _checkpoint(tmp_path, _job())
    assert check_resume(_job("model.vocab_size=1024"), path, vocab_known=False) == []
    with pytest.raises(ConfigError, match="model.vocab_size is 512 in the checkpoint"):
        check_resume(_job("model.vocab_size=1024"), path)


def test_positions_learning_rate_and_data_are_announced_not_refused(tmp_path):
    path = _checkpoint(tmp_path, _job())
    lines = check_resume(_job("model.max_seq_len=2048", "optim.lr=1e-4",
                              "data.seq_len=128", "train.stop_at_step=9"), path)
    assert lines == [
        "resume: data.seq_len changed from 256 to 128 (checkpoint step-0000004)",
        "resume: optim.lr changed from 0.002 to 0.0001 (checkpoint step-0000004)",
        "resume: model.max_seq_len changed from 1024 to 2048 (checkpoint step-0000004)"]


def test_another_seed_is_refused(tmp_path):
    """The seed orders the data: another one would read other samples from here on."""
    path = _checkpoint(tmp_path, _job())
    with pytest.raises(ConfigError, match="train.seed is 1234 in the checkpoint"):
        check_resume(_job("train.seed=1"), path)


def test_a_long_value_is_cut_in_the_line(tmp_path):
    path = _checkpoint(tmp_path, _job())
    (line,) = check_resume(_job("train.sample_prompt=" + "x" * 5000), path)
    assert len(line) < 200 and line.endswith("... (checkpoint step-0000004)")


def test_a_checkpoint_without_recorded_model_args_compares_its_config_only(tmp_path):
    path = _checkpoint(tmp_path, _job(), model_args=False)
    assert check_resume(_job("model.n_layers=2"), path) == []
    with pytest.raises(ConfigError, match="train.objective is next_token in the checkpoint "
                                          "step-0000004 but dpo now"):
        check_resume(_job("train.objective=dpo", "data.kind=preference",
                          "data.path=pairs.jsonl"), path)


def test_the_keys_a_resume_holds_are_the_ones_each_loss_reads():
    from lmforge.train.resume_check import loss_keys

    assert loss_keys("next_token") == []
    assert sorted(loss_keys("dpo")) == ["train.beta", "train.label_smoothing"]
    assert loss_keys("ipo") == ["train.beta"]
    assert sorted(loss_keys("simpo")) == ["train.beta", "train.label_smoothing",
                                          "train.simpo_gamma"]
    assert loss_keys("orpo") == ["train.orpo_lambda"]


GRPO = ["train.objective=grpo", "data.kind=prompts", "data.path=p.jsonl",
        "rl.rewards=exact_answer,length", "rl.reward_weights=1,0.5"]


@pytest.mark.parametrize("change,key", [
    ("rl.beta=0.1", "rl.beta"), ("rl.loss_type=grpo", "rl.loss_type"),
    ("rl.temperature=0.7", "rl.temperature"), ("rl.top_p=0.9", "rl.top_p"),
    ("rl.scale_rewards=none", "rl.scale_rewards"), ("rl.epsilon=0.1", "rl.epsilon"),
    ("rl.epsilon_high=0.28", "rl.epsilon_high"),
    ("rl.mask_truncated_completions=true", "rl.mask_truncated_completions"),
    ("rl.num_generations=4", "rl.num_generations"),
    ("rl.rewards=exact_answer,format", "rl.rewards"),
    ("rl.reward_weights=1,2", "rl.reward_weights"),
    ("rl.answer_field=solution", "rl.answer_field"),
])
def test_a_grpo_resume_refuses_a_changed_loss_sampling_or_reward_key(tmp_path, change, key):
    path = _checkpoint(tmp_path, _job(*GRPO))
    extra = ("rl.format_pattern=x",) if "format" in change else ()
    with pytest.raises(ConfigError, match=rf"^train\.resume: (.*; )?{key} is .* in the "
                                          rf"checkpoint step-0000004 but .* now; "):
        check_resume(_job(*GRPO, change, *extra), path)


def test_a_grpo_resume_takes_rewards_spelled_another_way_and_announces_other_keys(tmp_path):
    """The rewards as a list or a comma-separated string are the same rewards; the
    completion length and the iterations per rollout may change (a curriculum)."""
    path = _checkpoint(tmp_path, _job(*GRPO))
    lines = check_resume(_job(*GRPO[:3], "rl.rewards=[exact_answer, length]",
                              "rl.reward_weights=[1.0, 0.5]", "rl.max_completion_length=64"),
                         path)
    assert lines == ["resume: rl.max_completion_length changed from 128 to 64 (checkpoint "
                     "step-0000004)"]


def test_a_reward_file_named_relative_before_and_absolute_now_is_the_same_reward(
        tmp_path, monkeypatch):
    """A run makes its paths absolute at start (config/paths.py); a checkpoint whose
    config.yaml names the reward file and the data as given (relative) continues under
    them, with nothing to announce."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.py").write_text("def f(prompts, completions, **kw): return []\n")
    path = _checkpoint(tmp_path, _job(*GRPO[:3], "rl.rewards=exact_answer,r.py:f"))
    assert check_resume(_job(*GRPO[:2], f"data.path={tmp_path}/p.jsonl",
                             f"rl.rewards=exact_answer,{tmp_path}/r.py:f"), path) == []
