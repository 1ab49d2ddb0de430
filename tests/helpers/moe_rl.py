"""A tiny Qwen3-MoE (transformers-made, ChatML tokenizer and template: 8 experts, top-2,
2 sparse layers) for the preference and GRPO runs under expert parallelism
(tests/distributed/test_expert_parallel_runs.py), and the worker that records each rank's
rollouts (``rollout_worker.py``).

``stop_logit``: the head's rows of the stop tokens (``<|endoftext|>``, ``<|im_end|>``)
moved along the mean of the final hidden states so that a sampled completion ends after
a few tokens now and then (a random model all but never says a stop token): completions
of one rollout end at different lengths, some ranks' all before others'."""
from __future__ import annotations

from pathlib import Path

import torch

from helpers.hf_models import hf_model_dir

MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16,
           num_hidden_layers=2, hidden_size=64, norm_topk_prob=True)


def moe_model_dir(root: Path, stop_logit: float | None = None) -> Path:
    """``root`` holding the tiny Qwen3-MoE and its tokenizer (``stop_logit``: the stop
    tokens' logit on an average hidden state, above the others' mean; None: as made)."""
    import transformers

    from lmforge.data.tokenizer import load_tokenizer

    hf_model_dir(root, "qwen3_moe", "chatml", **MOE)
    if stop_logit is None:
        return root
    tok = load_tokenizer(root)
    stops = sorted({*tok.eos_ids, tok.token_to_id("<|im_end|>")})
    model = transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32)
    ids = torch.arange(3, 200).reshape(1, -1)
    with torch.no_grad():
        h = model.model(ids).last_hidden_state[0]  # (tokens, dim), after the final norm
        mean = h.mean(0)
        head = model.lm_head.weight
        typical = (h @ head.T).mean()
        for s in stops:
            head[s] = mean * (stop_logit + typical) / mean.dot(mean)
    model.save_pretrained(root)
    return root
