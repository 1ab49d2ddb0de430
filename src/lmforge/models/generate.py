"""The one decoder: every place lmforge generates (``lmforge generate``, the end-of-run
sample, eval-sft, bench-eval's ``generate_until``) calls ``generate`` or
``generate_in_batches``.

How it works (docs/generation.md):

* **Left padding, per-row positions.** The prompts of a batch are right-aligned in one
  (batch, longest) block; row b starts at column ``start[b]`` and its positions count from
  there, so every row writes the same cache column at every step: one shape per step
  (what a compiled step and CUDA graphs need), a plain slice write, no ragged kernels.
  ``DecodeMask`` hides the padding. The cost is the padding's share of the prefill,
  which ``generate_in_batches`` keeps small by batching prompts of similar lengths.
* **One cache**, allocated once per (batch, prompt + new tokens) before the prefill.
* **Sampling on the device** (greedy, temperature, top-k, top-p, min-p) by the inverse
  CDF: one uniform per row per token, drawn from that row's own seeded generator, so a
  row's tokens do not depend on its batch mates. Stops (per-row stop ids and limits) are
  checked on the device; the host looks every ``sync_every`` tokens.
* **Log-probabilities**: each token's under the sampling distribution (what was drawn
  from: temperature, top-k, top-p, min-p applied; 0 for greedy) and under the model.
* **Sharded models** (FSDP2, tensor and sequence parallelism) decode as they train; under
  data parallelism each rank its own prompts, all stepping together (``decode_parallel``).
* **Compiled** (``compile=True``): the prefill runs eagerly, the one-token step is
  ``torch.compile``d over a static cache (CUDA graphs on a GPU), with batch and cache
  length rounded up to buckets so few shapes compile; ``compiled_shapes()`` counts them.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lmforge.models.attention import DecodeMask
from lmforge.models.common import KVCache, new_caches
from lmforge.models.decode_parallel import (all_done, group_max, sequence_shards,
                                            sharded_step)
from lmforge.models.packed_linear import compiled, packed_linears
from lmforge.models.sampling import (GREEDY, Sampling, Uniforms, check_sampling,  # noqa: F401
                                    sample)

SYNC_EVERY = 16  # tokens between the host's looks at the stop flags
PAD_ID = 0  # what padding columns and finished rows hold (never read)


@dataclass
class Completion:
    """One prompt's new tokens, why they ended (``stop``: a stop id, the last token;
    ``length``: the row's limit), and each token's log-probability under the sampling
    distribution and under the model."""
    ids: list[int]
    finish_reason: str
    sampling_logprobs: list[float]
    model_logprobs: list[float]


# ------------------------------------------------------------------------------ decoder

def generate(model: nn.Module, prompts: Sequence[Sequence[int]],
             max_new_tokens: Union[int, Sequence[int]], sampling: Sampling = GREEDY,
             stop_ids: Union[Sequence[int], Sequence[Sequence[int]]] = (),
             seeds: Union[int, Sequence[int]] = 0, compile: bool = False,
             sync_every: int = SYNC_EVERY, group=None) -> list[Completion]:
    """Decode every prompt (token ids) of one batch. ``max_new_tokens``, ``stop_ids`` and
    ``seeds``: one for all rows, or one per row. A row stops after a stop id (kept as its
    last token) or at its limit, and never runs past the model's context.
    ``group``: the data-parallel process group whose ranks decode their own prompts with
    one sharded model (every forward is collective): all step until every rank is done."""
    rows = len(prompts)
    limits = _per_row(max_new_tokens, rows)
    stops = _per_row(stop_ids, rows, nested=True)
    seeds = _per_row(seeds, rows)
    check_sampling(None, sampling.temperature, sampling.top_k, sampling.top_p,
                   min_p=sampling.min_p)
    context = model.args.max_seq_len
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"generate: prompt {i} is empty (give at least one token)")
        if len(p) >= context:
            raise ValueError(f"generate: prompt {i} has {len(p)} tokens, which leaves no "
                             f"room in the model's context of {context}")
    limits = [max(0, min(n, context - len(p))) for n, p in zip(limits, prompts)]
    if rows == 0 and group is not None:
        raise ValueError("generate: every rank of the group needs a prompt to decode")
    if rows == 0 or group_max(max(limits), group, model) == 0:
        return [Completion([], "length", [], []) for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        with _grad_off(model, compile), packed_for_decode(model, rows, compile):
            return _decode(model, prompts, limits, sampling, stops, seeds, compile,
                           sync_every, group)
    finally:
        model.train(was_training)


def generate_in_batches(model: nn.Module, prompts: Sequence[Sequence[int]],
                        max_new_tokens: Union[int, Sequence[int]], batch_size: int,
                        sampling: Sampling = GREEDY,
                        stop_ids: Union[Sequence[int], Sequence[Sequence[int]]] = (),
                        seed: int = 0, compile: bool = False,
                        progress: Optional[Callable[[int, int, float], None]] = None
                        ) -> list[Completion]:
    """``generate`` over any number of prompts, ``batch_size`` at a time, longest first
    (batch mates of similar length waste little padding), returned in the input's order.
    Prompt i samples with seed ``seed + i``, so its tokens are the same whatever the
    batch size. ``progress(done, total, new_tokens_per_s)`` after each batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size: {batch_size} must be >= 1")
    n = len(prompts)
    limits = _per_row(max_new_tokens, n)
    stops = _per_row(stop_ids, n, nested=True)
    order = sorted(range(n), key=lambda i: -len(prompts[i]))
    out: list[Optional[Completion]] = [None] * n
    began = time.perf_counter()
    with packed_for_decode(model, min(batch_size, n), compile):  # (once, not per batch)
        _each_batch(model, prompts, limits, stops, order, batch_size, sampling, seed, compile,
                    out, progress, began)
    return out


def _each_batch(model, prompts, limits, stops, order, batch_size, sampling, seed, compile,
                out, progress, began) -> None:
    n, tokens = len(prompts), 0
    for first in range(0, n, batch_size):
        chunk = order[first:first + batch_size]
        done = generate(model, [prompts[i] for i in chunk], [limits[i] for i in chunk],
                        sampling, [stops[i] for i in chunk], [seed + i for i in chunk],
                        compile=compile)
        for i, c in zip(chunk, done):
            out[i] = c
            tokens += len(c.ids)
        if progress is not None:
            progress(min(first + batch_size, n), n,
                     tokens / max(time.perf_counter() - began, 1e-9))


def _grad_off(model: nn.Module, compile: bool):
    """``inference_mode`` for the eager decode of a whole model: less bookkeeping per op
    than ``no_grad`` (about 5% of a CPU step at batch 1), and nothing it makes leaves the
    decoder but token ids and floats. ``no_grad`` for the compiled step, a model with
    compiled parts and a sharded one, whose graphs and hooks (FSDP2's) are built and tested
    under it."""
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if compile or sharded or compiled(model):  # (train.compile's blocks: traced under no_grad)
        return torch.no_grad()
    return torch.inference_mode()


def packed_for_decode(model: nn.Module, rows: int, compile: bool):
    """The eager CPU decode reads its linear weights packed (``models.packed_linear``);
    the compiled step keeps them as they are (the compiler cannot trace a packed tensor).
    A caller that decodes in several calls packs once around them all: the calls inside
    find the layers packed and leave them so."""
    if compile:
        return contextlib.nullcontext(0)
    device = next(model.parameters()).device
    return packed_linears(model, rows, free_bytes(device) if device.type == "cpu" else 0)


def _per_row(value, rows: int, nested: bool = False) -> list:
    """One value for every row, or a sequence of one per row."""
    if nested:
        value = list(value)
        if value and isinstance(value[0], (list, tuple)):
            per_row = [list(v) for v in value]
        else:
            return [list(value)] * rows
    elif isinstance(value, int):
        return [value] * rows
    else:
        per_row = list(value)
    if len(per_row) != rows:
        raise ValueError(f"generate: {len(per_row)} per-row values for {rows} prompts")
    return per_row


def _decode(model, prompts, limits, sampling, stops, seeds, compile, sync_every, group=None):
    device = next(model.parameters()).device
    real = len(prompts)
    if compile:  # dummy rows round the batch up to its bucket; they are done from the start
        extra = _bucket_batch(real) - real
        prompts, limits = list(prompts) + [[PAD_ID]] * extra, list(limits) + [0] * extra
        stops, seeds = list(stops) + [[]] * extra, list(seeds) + [0] * extra
    shards = sequence_shards(model, compile)  # (the prefill padded to a multiple)
    rows, width = len(prompts), -(-max(len(p) for p in prompts) // shards) * shards
    steps = group_max(max(limits), group, model)  # (every rank of a group runs as many)
    cache_len = _bucket_length(width + steps) if compile else width + steps + shards - 1
    check_cache_fits(model, rows, cache_len, device)
    start = torch.tensor([width - len(p) for p in prompts], device=device)  # (rows,)
    block = torch.full((rows, width), PAD_ID, dtype=torch.long)
    for i, p in enumerate(prompts):
        block[i, width - len(p):] = torch.tensor(p)
    caches = _static_caches(model, rows, cache_len) if compile else new_caches(
        model, rows, cache_len)
    logits = _prefill(model, block.to(device), start, caches, static=compile,
                      whole=shards > 1)
    step = _CompiledStep(model, caches, start, cache_len) if compile else None

    limit = torch.tensor(limits, device=device)
    stop_table = torch.tensor([s + [-1] * (max(map(len, stops)) - len(s)) for s in stops]
                              or [[-1]], dtype=torch.long, device=device).reshape(rows, -1)
    out = torch.full((rows, steps), PAD_ID, dtype=torch.long, device=device)
    sampling_lp = torch.zeros((rows, steps), device=device)
    model_lp = torch.zeros((rows, steps), device=device)
    count = torch.zeros(rows, dtype=torch.long, device=device)
    done = limit == 0
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    uniforms = None if sampling.greedy else Uniforms(seeds, device, sync_every)
    columns = torch.zeros(1, dtype=torch.long, device=device)  # (filled in place: a new
    # tensor from a host value would be a blocking copy, a sync per token on a GPU)
    for t in range(steps):
        token, lp_s, lp_m = sample(logits, sampling,
                                   None if uniforms is None else uniforms.at(t))
        live = ~done
        token = torch.where(live, token, PAD_ID)
        out[:, t], sampling_lp[:, t], model_lp[:, t] = token, lp_s, lp_m
        count += live
        hit = live & (token[:, None] == stop_table).any(-1)
        stopped |= hit
        done = done | hit | (count >= limit)
        if t + 1 == steps or ((t + 1) % sync_every == 0 and all_done(done, group)):
            break  # (the host looks every sync_every tokens: one sync, not one per token)
        column = width + t
        positions = (column - start)[:, None]  # (rows, 1)
        if step is not None:
            logits = step(token[:, None], positions, column)
        elif shards > 1:
            logits = _last(sharded_step(model, token, positions, start, column, caches,
                                        shards, PAD_ID), 0)
        else:
            mask = DecodeMask(start, columns.fill_(column))
            logits = _last(model(token[:, None], positions, mask, caches))
    return _completions(out, sampling_lp, model_lp, count, stopped, real)


def cache_bytes(model: nn.Module, rows: int, length: int) -> int:
    """The KV cache of ``rows`` x ``length`` positions, in the model's dtype."""
    dtype = next(model.parameters()).dtype
    return rows * length * KVCache.bytes_per_token(model.args, dtype)


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation can take: the GPU's free memory, or the host's available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62  # (no /proc: nothing to check against)


def check_cache_fits(model: nn.Module, rows: int, length: int, device) -> None:
    """Refuse, before allocating it, a cache the device cannot hold beside the model."""
    need, free = cache_bytes(model, rows, length), free_bytes(torch.device(device))
    if need > free:
        per_row = need / rows / 2**30
        raise ValueError(
            f"generate: the KV cache of {rows} rows x {length} positions needs "
            f"{need / 2**30:.2f} GiB ({per_row:.3f} GiB a row), {free / 2**30:.2f} GiB is "
            f"free on {device}: lower the batch size or the new tokens (or the prompts' "
            f"length)")


def _prefill(model, block, start, caches, static: bool, whole: bool = False
             ) -> torch.Tensor:
    """Run the padded prompts through the model, filling the caches; the last column's
    logits (rows, vocab) in fp32. The head is applied to that column only (``whole``:
    to every column, as sequence parallelism needs the sequence split evenly)."""
    width = block.shape[1]
    columns = torch.arange(width, device=block.device)
    for c in caches:
        c.columns = columns if static else None
    positions = (columns[None, :] - start[:, None]).clamp(min=0)  # (rows, width)
    mask = DecodeMask(start, columns)
    if whole or isinstance(model, FSDPModule):  # (FSDP: its head's weight is sharded
        # outside its forward)
        return _last(model(block, positions, mask, caches))
    h = model(block, positions, mask, caches, head=False)
    return _last(model.output(h[:, -1:]))


def _last(logits, column: int = -1) -> torch.Tensor:
    """The last column's logits (rows, vocab) in fp32, whole on every rank (tensor
    parallelism leaves them sharded over the vocabulary); or ``column``'s."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return logits[:, column].float()


def _completions(out, sampling_lp, model_lp, count, stopped, rows) -> list[Completion]:
    out, sampling_lp, model_lp = out.tolist(), sampling_lp.tolist(), model_lp.tolist()
    result = []
    for i, (n, hit) in enumerate(zip(count.tolist(), stopped.tolist())):
        if i == rows:
            break
        result.append(Completion(out[i][:n], "stop" if hit else "length",
                                 sampling_lp[i][:n], model_lp[i][:n]))
    return result


# --------------------------------------------------------------------- compiled step

_SHAPES: set = set()  # (rows, cache length, device type): the buckets decoded so far
_GRAPHS = [0]  # graphs torch.compile built for the step (a recompile adds one)
_POOL: dict = {}  # the last static caches, reused: a CUDA graph reads fixed addresses


def compiled_shapes() -> int:
    """How many graphs the compiled decode step has been compiled into in this process
    (one per bucketed shape; more would mean a recompile the buckets did not prevent)."""
    return _GRAPHS[0]


def _bucket_batch(rows: int) -> int:
    """The next power of two: at most log2(batch) batch shapes."""
    return 1 << max(0, rows - 1).bit_length()


def _bucket_length(n: int) -> int:
    """Cache lengths in steps of 256 (at least 256): a step attends over the whole static
    cache, so finer buckets would save compute but compile more shapes."""
    return max(256, -(-n // 256) * 256)


def _static_caches(model, rows: int, cache_len: int) -> list[KVCache]:
    """The static caches of this shape: the last ones if the shape is the same (keys a
    row has not written are masked, so what an earlier batch left there is never read),
    else new ones."""
    p = next(model.parameters())
    key = (id(model), rows, cache_len, p.dtype, p.device)
    if key not in _POOL:
        _POOL.clear()
        _POOL[key] = new_caches(model, rows, cache_len)
    return _POOL[key]


class _CompiledStep:
    """The one-token step over static caches: every cache writes at ``columns`` (one
    tensor they share, updated in place) and returns its whole buffer, so the step's
    shapes never change while a batch decodes; on CUDA, ``reduce-overhead`` replays it
    as a CUDA graph."""

    def __init__(self, model, caches: list, start: torch.Tensor, cache_len: int):
        self.model, self.caches, self.start = model, caches, start
        self.columns = torch.zeros(1, dtype=torch.long, device=start.device)
        for c in caches:  # (after the prefill, which may have sized them: see KVCache)
            for buffer in c.buffers():  # (a KVCache's keys and values, a linear layer's
                torch._dynamo.mark_static_address(buffer)  # state)
        _SHAPES.add((len(start), cache_len, start.device.type))
        self.fn = _compiled(start.device.type)

    def __call__(self, token, positions, column: int) -> torch.Tensor:
        for c in self.caches:
            c.columns = self.columns
        self.columns.fill_(column)
        from torch._dynamo.utils import counters  # (what the compiler has built)

        before = counters["stats"]["unique_graphs"]
        logits = self.fn(self.model, token, positions, self.start, self.columns, self.caches)
        _GRAPHS[0] += counters["stats"]["unique_graphs"] - before
        return logits.clone()  # (a CUDA graph's output is overwritten by its next replay)


def _step(model, token, positions, start, columns, caches) -> torch.Tensor:
    return _last(model(token, positions, DecodeMask(start, columns), caches))


_COMPILED_FNS: dict = {}


def _compiled(device_type: str):
    if device_type not in _COMPILED_FNS:
        mode = "reduce-overhead" if device_type == "cuda" else None
        _COMPILED_FNS[device_type] = torch.compile(_step, mode=mode, dynamic=False)
    return _COMPILED_FNS[device_type]
