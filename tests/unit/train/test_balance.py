"""An MoE model's training step adds transformers' load-balancing loss: one step's
gradients through ``accumulate_gradients`` (with ``ExpertBalance``) equal those of
transformers' Qwen3-MoE loss with ``output_router_logits`` (cross-entropy +
router_aux_loss_coef x aux), and the logged ``moe/aux_loss`` is transformers' aux_loss;
the expert load is the busiest expert's assignments over the mean; a dense model has no
balance."""
from __future__ import annotations

import pytest
import torch

from helpers.hf_models import random_hf_causal_lm
from lmforge import IGNORE_INDEX
from lmforge.models.hf import load_hf_model
from lmforge.models.registry import PRESETS, build_model
from lmforge.train.balance import ExpertBalance
from lmforge.train.step import accumulate_gradients


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    hf = random_hf_causal_lm("qwen3_moe", seed=3, moe_intermediate_size=24, num_experts=8,
                             num_experts_per_tok=2, norm_topk_prob=True,
                             router_aux_loss_coef=0.5)  # (large: the aux term matters)
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(path)
    return hf.train(), load_hf_model(path).train()


def test_step_gradients_and_aux_loss_equal_transformers(models):
    hf, ours = models
    x = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = hf(x, labels=x, output_router_logits=True)
    out.loss.backward()

    labels = torch.cat([x[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    balance = ExpertBalance.of(ours, 1)
    accumulate_gradients(ours, [{"input_ids": x, "labels": labels}], torch.device("cpu"),
                         balance=balance)
    balance.reduce()
    assert balance.metrics()["moe/aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
    theirs = dict(hf.named_parameters())
    for ours_name, theirs_name in (
            ("layers.1.feed_forward.gate.weight", "model.layers.1.mlp.gate.weight"),
            ("layers.0.feed_forward.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj"),
            ("layers.0.attention.q_proj.weight", "model.layers.0.self_attn.q_proj.weight")):
        got = ours.get_parameter(ours_name).grad
        torch.testing.assert_close(got, theirs[theirs_name].grad, rtol=1e-4, atol=1e-6)


def test_expert_load_is_the_busiest_expert_over_the_mean_in_the_worst_layer():
    model = build_model(PRESETS["qwen3-moe-debug"], "meta")
    balance = ExpertBalance.of(model, 1)
    balance.counts[:] = 1.0
    balance.counts[-1, 0] = 17.0  # 16 experts: mean 2, busiest 17
    balance.reduce()
    assert balance.metrics()["moe/load_max_over_mean"] == pytest.approx(8.5)


def test_a_dense_model_has_no_balance():
    assert ExpertBalance.of(build_model(PRESETS["debug"], "meta"), 1) is None


def test_expert_bias_update_moves_each_routers_bias_towards_the_mean_load():
    """DeepSeek-V3's aux-loss-free balancing: +step for an underloaded expert, -step for
    an overloaded one, from the step's counts."""
    model = build_model(PRESETS["deepseek-v3-debug"], "cpu")
    balance = ExpertBalance.of(model, 1)
    balance.counts[:] = torch.arange(balance.counts.shape[1], dtype=torch.float64)
    balance.reduce()
    for moe in balance.moes:
        moe.gate.e_score_correction_bias.zero_()
    balance.update_biases(0.001)
    load = balance.counts[0]
    want = 0.001 * torch.sign(load.mean() - load).float()
    for moe in balance.moes:
        torch.testing.assert_close(moe.gate.e_score_correction_bias, want)
    assert want[0] > 0 and want[-1] < 0


def test_expert_bias_update_is_refused_for_routers_without_a_correction_bias():
    from lmforge.config import ConfigError, load_config
    from lmforge.models.presets import validate_job
    cfg = load_config(None, ["model.preset=qwen3-moe-debug", "train.expert_bias_update=0.001"])
    with pytest.raises(ConfigError, match="train.expert_bias_update: 0.001 needs routers"):
        validate_job(cfg)
