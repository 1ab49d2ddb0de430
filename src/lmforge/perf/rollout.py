"""GRPO's rollout in the memory estimate (docs/rl.md, "Memory"): what a step holds while
the one batched decoder (``models.generate``) samples a micro-batch of prompts'
completions, before the step trains on them (``train/grpo.py``).

A micro-batch of P prompts decodes as P x rl.num_generations rows, each up to data.seq_len
positions (a prompt is at most data.seq_len - rl.max_completion_length tokens, refused
otherwise, and its completion rl.max_completion_length): the estimate reads no data, so
the longest prompt is that bound. The rollout holds, beside the weights and the optimizer
state (gradients are freed by then):
- the KV cache of every row and position, in the weights' dtype (``KVCache``), of the
  full-attention layers; a linear-attention layer's state per row instead, whatever the
  length (``GatedDeltaNetState``: its convolution window and its fp32 state);
- the prefill's transient activations: under ``no_grad`` nothing is kept for backward,
  so the most alive at once is inside one block's MLP, for every prompt token: the
  residual stream, the attention's sum and the norm's output (3 x dim), and the MLP's
  up projection, activation and their product (3 x ffn), in the weights' dtype (the
  rollout runs without autocast);
- the logits of one position per row and the sampler's copies of them (log-softmax,
  tempered probabilities, top-p's sorted values and their int64 order, the CDF);
- on the CPU, the packed copy of the plain fp32 linear weights the eager decoder reads
  (``models/packed_linear.py``): every block projection and the head with full weights;
  the head alone with LoRA (an adapted layer is not packed: counted as if every
  projection were adapted); none when the model is sharded (tp, FSDP).
The cache is freed before the step's forward, so the rollout is a phase of the step of
its own: the estimate's peak is the larger of it and the training phases.
"""
from __future__ import annotations

import torch

from lmforge.config import JobConfig
from lmforge.models.common import KVCache
from lmforge.perf import linear_attention
from lmforge.perf.estimate_setup import DTYPE_BYTES, Setup
from lmforge.perf.weights import model_parameters

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fp32 (rows, vocab) tensors alive at once while a token is sampled (models/sampling.py):
# the logits, their log-softmax, the tempered logits and the probabilities, with top-p
# its sorted values and order (int64: two) beside them; 5.6 measured with top-p
# (tests/unit/perf/test_rollout_memory.py).
SAMPLING_COPIES = 6
# per prompt token, in units of dim and of ffn_dim: the prefill's peak inside an MLP
PREFILL_DIMS, PREFILL_FFNS = 3, 3
ROLLOUT = "rollout (generate)"  # the phase's name in the estimate


def kv_cache_bytes_per_token(setup: Setup) -> int:
    """What generating with the run's model holds per token of each row: every layer's
    keys and values in the weights' dtype (``KVCache.bytes_per_token``, the decoder's
    own count; under tp each rank keeps its share of the kv heads)."""
    args = setup.args
    per_token = KVCache.bytes_per_token(args, TORCH_DTYPES[setup.cfg.train.param_dtype])
    # (a linear-attention layer keeps a state of its own instead: ``decode_state_bytes``)
    per_token = per_token * linear_attention.full_attention_layers(args) // args.n_layers
    return per_token // setup.layout.tp


def decode_state_bytes(setup: Setup) -> int:
    """What generating holds per row, whatever its length: each linear-attention layer's
    ``GatedDeltaNetState`` (0 without such layers; under tp each rank's holds its
    heads)."""
    return linear_attention.decode_state_bytes_per_row(
        setup.args, TORCH_DTYPES[setup.cfg.train.param_dtype], setup.layout.tp)


def rollout_rows(setup: Setup) -> int:
    """Rows the decoder runs at once: a micro-batch's prompts x rl.num_generations."""
    return setup.micro_batch


def rollout_terms(setup: Setup) -> dict[str, float]:
    """The rollout's own terms (bytes per device), beside the static ones; {} for an
    objective without a rollout."""
    if setup.job.objective != "grpo":
        return {}
    rows, length = rollout_rows(setup), setup.batch.seq_len
    prompt = length - setup.cfg.rl.max_completion_length
    args, tp = setup.args, setup.layout.tp
    prefill = (PREFILL_DIMS * args.dim + PREFILL_FFNS * args.ffn_dim / tp) * DTYPE_BYTES[
        setup.cfg.train.param_dtype]
    terms = {"rollout KV cache": rows * length * kv_cache_bytes_per_token(setup),
             "rollout prefill (one block)": rows * prompt * prefill,
             "rollout logits and sampling": rows * args.vocab_size / tp * 4 * SAMPLING_COPIES}
    if decode_state_bytes(setup):
        terms["rollout linear-attention state"] = rows * decode_state_bytes(setup)
    packed = packed_weight_bytes(setup)
    if packed:
        terms["rollout packed weights (CPU)"] = packed
    return terms


def packed_weight_bytes(setup: Setup) -> float:
    """The eager CPU decoder's packed copy of the plain fp32 linear weights (see above)."""
    if (setup.device != "cpu" or setup.cfg.train.param_dtype != "fp32"
            or setup.layout.tp > 1 or setup.layout.fsdp_shard > 1):
        return 0.0
    args = setup.args
    head = args.vocab_size * args.dim
    if setup.lora is not None:
        return 4.0 * head
    embedding = 0 if args.tie_embeddings else head  # (the model's count has one of them)
    return 4.0 * (model_parameters(args) - embedding)


def describe_rollout(setup: Setup, terms: dict[str, float], total: float, peak_phase: str) -> str:
    """The estimate's line for the rollout phase."""
    gib = 2**30
    rl = setup.cfg.rl
    parts = ", ".join(f"{name.removeprefix('rollout ')} {v / gib:.3f}"
                      for name, v in terms.items())
    where = "the peak" if peak_phase == ROLLOUT else f"below the peak ({peak_phase})"
    return (f"rollout: {rollout_rows(setup)} rows ({rollout_rows(setup) // rl.num_generations}"
            f" prompts x rl.num_generations {rl.num_generations}) x {setup.batch.seq_len} "
            f"positions (data.seq_len: the longest prompt allowed and rl.max_completion_length "
            f"{rl.max_completion_length}): "
            f"{parts} GiB; with the static terms {total / gib:.3f} GiB, {where}")


def rollout_changes(cfg: JobConfig) -> list[tuple[str, dict]]:
    """(what to write, keys) for each single change that shrinks a GRPO rollout and its
    rows: half the group (at least 2), half the completion (data.seq_len shortened by as
    much, so that the prompts keep their room); data.micro_batch_size is the callers'."""
    if cfg.train.objective != "grpo":
        return []
    rl, out = cfg.rl, []
    if rl.num_generations > 2:
        g = max(2, rl.num_generations // 2)
        out.append((f"rl.num_generations={g}", {"rl.num_generations": g}))
    if rl.max_completion_length > 1:
        c = rl.max_completion_length // 2
        seq = cfg.data.seq_len - (rl.max_completion_length - c)
        out.append((f"rl.max_completion_length={c} with data.seq_len={seq}",
                    {"rl.max_completion_length": c, "data.seq_len": seq}))
    return out
