"""GRPO in the trainer, on the CPU with a tiny ChatML model: prompts (text and chat
messages, with their fields) become rollouts through the batched decoder, the step trains
on them and logs TRL's metrics with the seconds generating, scoring and training; a run
stopped and resumed gives the uninterrupted run's losses and rewards exactly; full weights
and LoRA with a reference (rl.beta > 0); and the prompts reader's refusals."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.grpo_prompts import VOWELS, sum_records, write_prompts
from helpers.preference_data import model_dir
from lmforge.config import load_config
from lmforge.data.errors import DataError
from lmforge.data.prompts import PromptDataset, check_prompts
from lmforge.data.tokenizer import load_tokenizer
from lmforge.train.loop import train

ROLLOUT_METRICS = ("reward", "reward_std", "rewards/exact_answer/mean",
                   "rewards/length/mean", "frac_reward_zero_std", "completions/mean_length",
                   "completions/clipped_ratio", "entropy", "clip_ratio/region_mean",
                   "time/generate_s", "time/score_s", "time/train_s")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo-train")
    model = model_dir(root)
    data = root / "prompts.jsonl"
    write_prompts(data, sum_records(24))
    return model, data


def _run(setup, out, *extra):
    model, data = setup
    cfg = load_config(None, [f"model.init_from={model}", "data.kind=prompts",
                             f"data.path={data}", "data.seq_len=48",
                             "data.micro_batch_size=2", "rl.num_generations=3",
                             "rl.max_completion_length=8", "rl.rewards=exact_answer,length",
                             "rl.reward_weights=[1.0, 0.1]", "train.max_steps=3",
                             "train.log_every=1", "train.eval_every=3", "train.eval_batches=2",
                             "train.save=false", f"train.output_dir={out}", "optim.lr=1e-2",
                             "train.device=cpu", "train.sample_tokens=4", *extra])
    summary = train(cfg)
    return summary, [json.loads(line) for line in (out / "metrics.jsonl").open()]


def test_a_grpo_run_trains_on_its_rollouts_and_logs_trls_metrics(setup, tmp_path):
    summary, history = _run(setup, tmp_path / "run", "rl.beta=0.04")
    assert [r["step"] for r in history] == [1, 2, 3]
    for record in history:
        for name in ROLLOUT_METRICS + ("kl", "loss", "completion_tokens"):
            assert name in record, name
        assert record["completions/max_length"] <= 8
        assert record["time/generate_s"] > 0 and record["time/train_s"] > 0
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # (the policy is the reference)
    assert "eval_reward" in history[-1] and history[-1]["eval_prompts"] == 1  # (5% of 24)
    assert (summary["eval_reward"], summary["eval_prompts"]) == (history[-1]["eval_reward"], 1)


@pytest.mark.parametrize("extra", [
    (), ("lora.enabled=true", "lora.rank=4", "rl.beta=0.1"),
    pytest.param(("lora.enabled=true", "lora.rank=4", "lora.quantize=nf4", "rl.beta=0.1"),
                 marks=pytest.mark.slow),
    # (its checkpoint after step 2: the next step samples; train.checkpoint_every=2)
    pytest.param(("rl.num_iterations=2", "rl.beta=0.04", "train.max_steps=4"),
                 marks=pytest.mark.slow)],
    ids=["full", "lora", "qlora", "num_iterations_2"])
def test_a_stopped_and_resumed_run_samples_scores_and_trains_as_one(setup, tmp_path, extra):
    _, whole = _run(setup, tmp_path / "whole", *extra)
    out = tmp_path / "parts"
    every = "train.checkpoint_every=2" if "rl.num_iterations=2" in extra else \
        "train.checkpoint_every=1"
    _run(setup, out, *extra, "train.save=true", every, "train.stop_at_step=2")
    _, resumed = _run(setup, out, *extra, "train.save=true", every, "train.resume=auto")
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    for a, b in zip(whole, resumed):
        for key in ("loss", "reward", "completions/mean_length", "grad_norm"):
            assert a.get(key) == b.get(key), (a["step"], key)


def test_num_iterations_2_trains_each_rollout_twice_against_its_policy(setup, tmp_path,
                                                                      monkeypatch):
    """rl.num_iterations=2: steps 1 and 3 sample (reading prompts), steps 2 and 4 train
    on the same completions again (no prompts read, no rollout metrics but the times).
    Step 1's ratio is 1 (the rollout's log-probabilities are the policy's); step 2's is
    not, and its loss is models/grpo.py's with the old log-probabilities being what the
    policy gave those tokens in step 1."""
    from lmforge.models.grpo import loss_sum, units
    from lmforge.train import grpo as trainer_grpo

    calls = []

    def recording_per_token_loss(logps, old, ref, adv, p):
        calls.append({"logps": logps.detach().clone(), "old": old, "ref": ref, "adv": adv,
                      "params": p})
        return per_token_loss(logps, old, ref, adv, p)

    def recording_loss_sum(token_loss, mask, p):
        calls[-1]["mask"] = mask
        return loss_sum(token_loss, mask, p)

    per_token_loss = trainer_grpo.per_token_loss
    monkeypatch.setattr(trainer_grpo, "per_token_loss", recording_per_token_loss)
    monkeypatch.setattr(trainer_grpo, "loss_sum", recording_loss_sum)
    _, history = _run(setup, tmp_path / "run", f"rl.rewards=exact_answer,{VOWELS}",
                      "rl.reward_weights=1.0,2.0", "rl.num_iterations=2", "rl.beta=0.04",
                      "rl.epsilon=0.05", "rl.loss_type=grpo", "train.max_steps=4",
                      "train.eval_every=0")
    consumed = [r["consumed_samples"] for r in history]
    assert consumed[0] == consumed[1] > 0 and consumed[2] == consumed[3] == 2 * consumed[0]
    for r in (history[1], history[3]):
        assert r["time/generate_s"] == 0 and "reward" not in r
    assert "reward" in history[0] and "reward" in history[2]
    accum = len(calls) // 4
    first, second = calls[:accum], calls[accum:2 * accum]
    for one, two in zip(first, second):
        assert one["old"] is not None
        torch.testing.assert_close(one["logps"], one["old"], rtol=0, atol=1e-6)  # ratio 1
        assert torch.equal(two["old"], one["old"]) and torch.equal(two["adv"], one["adv"])
        assert float((two["logps"] - two["old"]).abs().max()) > 1e-3  # ratio != 1
    p = second[0]["params"]
    total = sum(loss_sum(per_token_loss(c["logps"], one["logps"], c["ref"], c["adv"], p)[0],
                         c["mask"], p) for c, one in zip(second, first))
    count = sum(units(c["mask"], p.loss_type) for c in second)
    assert history[1]["loss"] == pytest.approx(float(total / count), rel=1e-5)
    assert history[1]["clip_ratio/region_mean"] > 0  # (epsilon 0.05: some are clipped)
    assert 0 <= history[1]["clip_ratio/low_min"] <= history[1]["clip_ratio/low_mean"]
    assert history[1]["clip_ratio/high_max"] >= history[1]["clip_ratio/high_mean"]


def test_prompt_records_keep_their_fields_and_render_chat_messages(setup):
    model, data = setup
    tok = load_tokenizer(model)
    ds = PromptDataset(data, tok, "auto", 40, seed=0)
    batch = ds.batch([0, 1, 2])["prompts"]
    for ids, record in zip(batch.ids, batch.records):
        text = tok.decode(ids, skip_special=False)
        if isinstance(record["prompt"], list):  # the template's user turn and generation prompt
            assert "<|im_start|>assistant" in text and record["prompt"][0]["content"] in text
        else:
            assert text == record["prompt"]
        assert "answer" in record and "id" in record
    assert batch.stop_ids  # (the end of turn and EOS)


@pytest.mark.parametrize("line,match", [
    ('["not", "an", "object"]', r"p\.jsonl:2: a prompt record is a JSON object"),
    ('{"answer": 3}', r"p\.jsonl:2: the record has no 'prompt'$"),
    ('{"prompt": "  "}', r"p\.jsonl:2: 'prompt' is empty"),
    ('{"prompt": 7}', r"p\.jsonl:2: 'prompt' must be a string or a list of messages"),
    ('{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
     r"p\.jsonl:2: 'prompt' must end with a user message"),
    ('{"prompt": [{"role": "robot", "content": "a"}]}', r"p\.jsonl:2: 'prompt' message 1 has role"),
    ('{"prompt": "a" ', r"p\.jsonl:2: "),
])
def test_a_bad_prompt_record_is_refused_naming_its_line(tmp_path, line, match):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=match):
        check_prompts("data.path", path)


def test_a_prompt_too_long_for_its_completion_is_refused_naming_its_line(setup, tmp_path):
    model, _ = setup
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "short"}\n' + json.dumps({"prompt": "word " * 60}) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:2: the prompt has \d+ tokens; data\.seq_len "
                                         r"- rl\.max_completion_length leaves 20$"):
        PromptDataset(path, load_tokenizer(model), "auto", 20)


def test_the_trainers_rows_score_what_the_completion_aligned_layout_scores(setup):
    """Prompts of different lengths right-padded with their completions (the trainer's
    rows: ``completion_rows``, ``label_logps``) give each completion token the
    log-probability and entropy it has scored alone (``completion_logps``, the layout the
    TRL comparison uses), and the loss of those rows is the rows' own losses' mean."""
    import torch

    from lmforge.models.grpo import GRPOParams, completion_logps, grpo_loss
    from lmforge.models.hf import load_hf_model
    from lmforge.train.grpo import completion_rows, label_logps

    model = load_hf_model(setup[0])
    prompts, completions = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21], [22, 23, 24], []]
    adv = torch.tensor([0.5, -1.0, 0.3])
    p = GRPOParams(beta=0.2, loss_type="grpo", max_completion_length=4)
    rows = completion_rows(prompts, completions, adv, torch.arange(3))
    logps, entropy = label_logps(model(rows["input_ids"]), rows["labels"], 0.7)
    mask = rows["completion_mask"]
    loss, _ = grpo_loss(logps, None, logps.detach() - 0.3 * mask, adv, mask, p)
    apart = []
    for r, (pr, c, a) in enumerate(zip(prompts, completions, adv)):
        assert int(mask[r].sum()) == len(c)
        if not c:
            apart.append(torch.zeros(()))
            continue
        logits = model(torch.tensor([pr + c]))[:, len(pr) - 1:-1]
        lp, ent = completion_logps(logits, torch.tensor([c]), 0.7)
        torch.testing.assert_close(logps[r][mask[r].bool()], lp[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(entropy[r][mask[r].bool()], ent[0], rtol=1e-5, atol=1e-6)
        apart.append(grpo_loss(lp, None, lp.detach() - 0.3, a[None], torch.ones(1, len(c)),
                               p)[0])
    torch.testing.assert_close(loss, torch.stack(apart).mean(), rtol=1e-5, atol=1e-6)


def test_a_rollout_is_reused_num_iterations_steps_and_a_resume_samples_afresh():
    """Which steps read new prompts (the loop asks before reading; a stop signal takes
    effect only before such a step): with num_iterations 3, steps 1, 4, 7; a run resumed
    after step 3 (no rollout held) samples at step 4 as the uninterrupted one does, and
    one resumed from a final checkpoint inside a rollout samples at once."""
    from lmforge.models.grpo import GRPOParams
    from lmforge.models.sampling import GREEDY
    from lmforge.train.grpo import GRPO

    objective = GRPO(GRPOParams(), [], 2, GREEDY, num_iterations=3)
    assert objective.takes_new_batches(5)  # (nothing held yet: a resumed run)
    objective._rollout = [{}]  # (what prepare keeps)
    assert [s for s in range(1, 10) if objective.takes_new_batches(s)] == [1, 4, 7]


def test_mask_truncated_completions_zeroes_the_mask_of_every_completion_cut_at_the_limit(
        setup, tmp_path, monkeypatch):
    """TRL's rule: a completion that reached rl.max_completion_length without an end token
    adds nothing to the loss (its completion mask is zero); one that ended keeps its
    tokens. Without the key, every completion keeps its tokens."""
    from lmforge.train import grpo as trainer_grpo

    sampled, masks = [], []
    generate, loss_sum = trainer_grpo.generate, trainer_grpo.loss_sum

    def recording_generate(*args, **kwargs):
        sampled.extend(generate(*args, **kwargs))
        return sampled[-len(args[1]):]

    def recording_loss_sum(token_loss, mask, p):
        masks.append(mask.detach().clone())
        return loss_sum(token_loss, mask, p)

    monkeypatch.setattr(trainer_grpo, "generate", recording_generate)
    monkeypatch.setattr(trainer_grpo, "loss_sum", recording_loss_sum)
    for masked in (False, True):
        sampled.clear(), masks.clear()
        _, history = _run(setup, tmp_path / str(masked), "train.max_steps=1",
                          "train.eval_every=0", "data.eval_fraction=0", "optim.warmup_steps=0",
                          f"rl.mask_truncated_completions={str(masked).lower()}")
        rows = torch.cat(masks).sum(-1).tolist()
        cut = [c.finish_reason == "length" for c in sampled]
        assert any(cut) and len(rows) == len(sampled)
        assert rows == [0 if masked and c else len(s.ids) for s, c in zip(sampled, cut)]
        assert history[0]["completion_tokens"] == sum(rows)


def test_a_reward_that_changes_the_working_directory_moves_none_of_the_runs_files(
        setup, tmp_path, monkeypatch):
    """The run directory and the relative paths (the prompts, the reward's file) are made
    absolute once, at start: checkpoints, metrics and hf/ land where the command said
    although a reward calls os.chdir (into a folder this test made) at every step."""
    import shutil

    model, data = setup
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    shutil.copy(data, home / "prompts.jsonl")
    (home / "wander.py").write_text(
        "import os\n"
        "def wander(prompts, completions, **kwargs):\n"
        f"    os.chdir({str(elsewhere)!r})\n"
        "    return [0.0] * len(completions)\n")
    monkeypatch.chdir(home)
    cfg = load_config(None, [f"model.init_from={model}", "data.kind=prompts",
                             "data.path=prompts.jsonl", "data.seq_len=48",
                             "data.micro_batch_size=2", "rl.num_generations=2",
                             "rl.max_completion_length=4", "rl.rewards=length,wander.py:wander",
                             "train.max_steps=2", "train.checkpoint_every=1",
                             "train.output_dir=run", "train.device=cpu",
                             "train.sample_tokens=2", "optim.warmup_steps=0"])
    train(cfg)
    run = home / "run"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()] == [1, 2]
    assert (run / "hf" / "config.json").is_file() and (run / "config.yaml").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step-0000002"
    assert list(elsewhere.iterdir()) == []


def test_a_reward_weight_beyond_float32_trains_with_finite_rewards(setup, tmp_path):
    """Rewards are summed in float64: a weight of 1e39 gives rewards of about 1e38 (in
    float32, inf: every advantage NaN, nothing trained), and the group-normalised
    advantages train as with weight 1."""
    import math

    _, history = _run(setup, tmp_path / "run", f"rl.rewards={VOWELS}",
                      "rl.reward_weights=1e39", "train.max_steps=1", "train.eval_every=0",
                      "data.eval_fraction=0", "optim.warmup_steps=0")
    record = history[0]
    assert math.isfinite(record["reward"]) and 1e36 < record["reward"] < 1e39
    assert math.isfinite(record["rewards/vowels/mean"]) and record["grad_norm"] > 0
