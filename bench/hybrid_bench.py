"""Qwen3.5's hybrid (Gated DeltaNet linear attention + gated full attention) on the CPU:
lmforge against transformers' PyTorch path, side by side in one run (issue 47, point 7).

    python bench/hybrid_bench.py [--rounds 3] [--threads N] [--only train,decode,step]
                                 [--out rows.json]
    python bench/hybrid_bench.py --quick        # tiny sizes, a few seconds (the test's)

One random model (transformers' ``Qwen3_5TextConfig``, fp32, the released pattern of
three linear layers then one full) is saved to a temporary directory; lmforge loads it
with ``load_hf_model`` and transformers with ``Qwen3_5ForCausalLM.from_pretrained``, so
both hold the same weights. Without flash-linear-attention (the CPU) transformers runs
its ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule``.

Each measurement warms both sides up, then runs ``--rounds`` rounds that alternate the
sides; each side's best (fastest) time is reported, the one other jobs on a shared
machine disturbed least (a niced job on two busy cores gets a tenth of them, and a
thread of two that is descheduled stalls the other at every parallel op: on a 2-core
machine shared with other jobs, the same train step took 17.7 s in one round and 4.4 s
in the next). Two clocks: wall time, and the process's CPU time (every thread's; with
one thread, ``--threads 1``, the work itself; with two it also counts a thread spinning
while it waits for the other). ``--out`` keeps every sample. The three measurements:

1. **train step**: forward, backward and AdamW step at batch 1, ``seq`` tokens;
   lmforge's loss is the trainer's (``micro_batch_loss_sum``), transformers' the
   cross-entropy of its logits. Tokens per second; both first-step losses (equal
   weights: they agree).
2. **decoding**: greedy, fixed random prompts, batch 1 and 8: lmforge's ``generate``
   against ``model.generate(do_sample=False, use_cache=True)``. New tokens per second
   over the whole call (prefill included) and whether the tokens are equal.
3. **decode step vs context**: one prompt of 256 and one of 4,096 tokens, then
   one-token steps; forward hooks time each step's model call and, within it, the
   linear layers' mixers (Gated DeltaNet) and the full layers' (gated attention) apart.
   A linear layer's step reads a fixed-size state, so its cost should not grow with the
   context (ratio 4096/256 near 1); a full layer's reads a KV cache that does.

The last lines are a markdown table of every row (``--out``: the rows as JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

LINEAR, FULL = "linear_attention", "full_attention"

# Qwen3.5-9B scaled down 8x in width, keeping what sets the per-head work: the linear
# layers' head dims (128, a 128 x 128 state per value head), two value heads per key
# head, the full layers' head_dim 128 and 4 query heads per kv head, the MLP 3x the width
# and the layer pattern. A small vocabulary keeps the head from hiding the layers.
FULL_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=128, intermediate_size=1536,
                  vocab_size=8192, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=128, linear_value_head_dim=128)
FULL_SIZES = dict(seq=2048, batches=(1, 8), prompt=32, new_tokens=64,
                  contexts=(256, 4096), step_tokens=16)
QUICK_SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=256,
                   linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32,
                   linear_value_head_dim=32)
QUICK_SIZES = dict(seq=128, batches=(1, 8), prompt=8, new_tokens=6, contexts=(16, 64),
                   step_tokens=4)

TRAIN_TARGET, DECODE_TARGET = 1.0, 1.5  # lmforge's speed over transformers' (issue 47)
FLAT_TARGET = 1.25  # a linear layer's step cost, 4096 / 256 context: flat, up to noise


# ---------------------------------------------------------------------- the model

def write_model(path: Path, shape: dict, max_len: int) -> None:
    """A random fp32 Qwen3.5 text model in ``path``: three linear layers, then a full."""
    import transformers

    layers = shape["num_hidden_layers"]
    config = transformers.Qwen3_5TextConfig(
        **shape, layer_types=[FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)],
        max_position_embeddings=max_len, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(path)


def load_lmforge(path: Path):
    from lmforge.models.hf import load_hf_model

    return load_hf_model(path)


def load_transformers(path: Path):
    import transformers

    return transformers.Qwen3_5ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa")


def random_ids(rows: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def now() -> dict:
    return {name: clock() for name, clock in CLOCKS.items()}


def since(began: dict) -> dict:
    return {name: clock() - began[name] for name, clock in CLOCKS.items()}


def alternate(rounds: int, timers: dict) -> dict:
    """Each side's ``timers[side]()`` once to warm up, then ``rounds`` times in turn;
    the seconds of every timed call, by clock and side."""
    for timer in timers.values():
        timer()
    seconds = {name: {side: [] for side in timers} for name in CLOCKS}
    for _ in range(rounds):
        for side, timer in timers.items():
            began = now()
            timer()
            for name, s in since(began).items():
                seconds[name][side].append(s)
    return seconds


def speed_row(section: str, case: str, unit: str, work: float, seconds: dict,
              target: float, note: str = "", **extra) -> dict:
    """A row of ``work`` per second of each side's best call, by both clocks; ``met``:
    lmforge's speed over transformers' by wall time reaches ``target``."""
    speed = {name: {side: work / min(s) for side, s in by_side.items()}
             for name, by_side in seconds.items()}
    ratio = {name: v["lmforge"] / v["transformers"] for name, v in speed.items()}
    return {"section": section, "case": case, "unit": unit,
            "lmforge": speed["wall"]["lmforge"], "transformers": speed["wall"]["transformers"],
            "ratio": ratio["wall"], "lmforge_cpu": speed["cpu"]["lmforge"],
            "transformers_cpu": speed["cpu"]["transformers"], "ratio_cpu": ratio["cpu"],
            "target": f">= {target}x", "met": ratio["wall"] >= target, "note": note,
            "seconds": seconds, **extra}


# ---------------------------------------------------------------------- 1. train step

def lmforge_train_step(model, optimizer, ids):
    from lmforge.models.loss import micro_batch_loss_sum

    def step():
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        loss = micro_batch_loss_sum(model, batch, torch.device("cpu")) / ids[:, 1:].numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def transformers_train_step(model, optimizer, ids):
    def step():
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def bench_train(path: Path, sizes: dict, vocab: int, rounds: int) -> list[dict]:
    seq = sizes["seq"]
    ids = random_ids(1, seq + 1, vocab, seed=1)
    steps, first_loss = {}, {}
    for side, load, make in (("lmforge", load_lmforge, lmforge_train_step),
                             ("transformers", load_transformers, transformers_train_step)):
        model = load(path).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        steps[side] = make(model, optimizer, ids)
        first_loss[side] = steps[side]()  # (the warm-up; before any update: same weights)
    seconds = alternate(rounds, steps)
    note = (f"first-step loss {first_loss['lmforge']:.5f} vs "
            f"{first_loss['transformers']:.5f}")
    return [speed_row("train step", f"fwd+bwd+AdamW, batch 1, seq {seq}", "tokens/s", seq,
                      seconds, TRAIN_TARGET, note, first_loss=first_loss)]


# ---------------------------------------------------------------------- 2. decoding

def lmforge_decode(model, prompts: torch.Tensor, new: int):
    from lmforge.models.generate import generate

    rows = prompts.tolist()
    return lambda: [c.ids for c in generate(model, rows, new)]


def transformers_decode(model, prompts: torch.Tensor, new: int):
    def run():
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 use_cache=True, pad_token_id=0)
        return out[:, prompts.shape[1]:].tolist()
    return run


def differing(ours: list[list[int]], theirs: list[list[int]]) -> int:
    """Token positions where the two sides' greedy ids differ."""
    return sum(x != y for a, b in zip(ours, theirs) for x, y in zip(a, b)) + sum(
        abs(len(a) - len(b)) for a, b in zip(ours, theirs))


def bench_decode(models: dict, sizes: dict, vocab: int, rounds: int) -> list[dict]:
    rows, new = [], sizes["new_tokens"]
    for batch in sizes["batches"]:
        prompts = random_ids(batch, sizes["prompt"], vocab, seed=2 + batch)
        runs = {"lmforge": lmforge_decode(models["lmforge"], prompts, new),
                "transformers": transformers_decode(models["transformers"], prompts, new)}
        tokens = {}

        def keeping(side):  # (the tokens of the last call, compared below)
            def run():
                tokens[side] = runs[side]()
            return run
        seconds = alternate(rounds, {side: keeping(side) for side in runs})
        differ = differing(tokens["lmforge"], tokens["transformers"])
        same = "tokens equal" if differ == 0 else f"TOKENS DIFFER: {differ} of {batch * new}"
        rows.append(speed_row("decoding", f"greedy, batch {batch}, prompt {sizes['prompt']}, "
                              f"{new} new", "new tokens/s", batch * new, seconds,
                              DECODE_TARGET, same, same_tokens=differ == 0,
                              tokens_differing=differ))
    return rows


# ----------------------------------------------------------- 3. decode step vs context

class StepClock:
    """Forward hooks on a model and its mixers that time every one-token call of the
    model (a decode step) and, inside it, the linear and the full mixers' calls, summed
    per step, by both clocks. The hooks are the only change: the decode runs as its
    caller runs it."""

    def __init__(self, model, linear: list, full: list):
        self.steps: list[dict] = []  # per step: {part: {clock: seconds}}
        self.current = None
        self.handles = [model.register_forward_pre_hook(self._model_in, with_kwargs=True),
                        model.register_forward_hook(self._model_out)]
        for kind, modules in (("linear", linear), ("full", full)):
            for m in modules:
                self.handles += [m.register_forward_pre_hook(self._mixer_in),
                                 m.register_forward_hook(self._mixer_out(kind))]

    def _model_in(self, module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            zero = {name: 0.0 for name in CLOCKS}
            self.current = {"began": now(), "linear": dict(zero), "full": dict(zero)}

    def _model_out(self, module, args, output):
        if self.current is not None:
            self.current["step"] = since(self.current.pop("began"))
            self.steps.append(self.current)
            self.current = None

    def _mixer_in(self, module, args):
        module._clock_began = now()

    def _mixer_out(self, kind):
        def hook(module, args, output):
            if self.current is not None:
                for name, s in since(module._clock_began).items():
                    self.current[kind][name] += s
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def mixers(side: str, model) -> tuple[list, list]:
    """(linear mixers, full mixers) of either side's model."""
    if side == "lmforge":
        from lmforge.models.gated_deltanet import GatedDeltaNet

        layers = [layer.attention for layer in model.layers.values()]
        return ([m for m in layers if isinstance(m, GatedDeltaNet)],
                [m for m in layers if not isinstance(m, GatedDeltaNet)])
    layers = model.model.layers
    return ([l.linear_attn for l in layers if hasattr(l, "linear_attn")],
            [l.self_attn for l in layers if hasattr(l, "self_attn")])


def bench_step_cost(models: dict, sizes: dict, vocab: int, rounds: int) -> list[dict]:
    """Per side and context: the best one-token step (ms) of the whole model, of its
    linear mixers and of its full mixers (each summed over its layers), by both clocks;
    then each part's growth from the shortest context to the longest."""
    new = sizes["step_tokens"] + 1  # (the first new token comes from the prefill)
    decoders = {"lmforge": lmforge_decode, "transformers": transformers_decode}
    samples = {}  # (side, context, part, clock) -> every timed step's ms
    for context in sizes["contexts"]:
        prompt = random_ids(1, context, vocab, seed=100 + context)
        clocks = {side: StepClock(m, *mixers(side, m)) for side, m in models.items()}
        alternate(rounds, {side: decoders[side](m, prompt, new) for side, m in models.items()})
        for side, clock in clocks.items():
            clock.remove()
            timed = clock.steps[-rounds * sizes["step_tokens"]:]  # (not the warm-up's)
            for part in ("step", "linear", "full"):
                for name in CLOCKS:
                    samples[side, context, part, name] = [1e3 * s[part][name] for s in timed]
    ms = {key: min(v) for key, v in samples.items()}
    n_linear, n_full = (len(x) for x in mixers("lmforge", models["lmforge"]))
    parts = {"step": "whole model", "linear": f"linear mixers ({n_linear} Gated DeltaNet)",
             "full": f"full mixers ({n_full} gated attention)"}
    rows = []
    for context in sizes["contexts"]:
        for part, name in parts.items():
            v = {(side, c): ms[side, context, part, c] for side in models for c in CLOCKS}
            rows.append({"section": "decode step", "case": f"{name}, context {context}",
                         "unit": "ms/step", "lmforge": v["lmforge", "wall"],
                         "transformers": v["transformers", "wall"],
                         "ratio": v["transformers", "wall"] / v["lmforge", "wall"],
                         "lmforge_cpu": v["lmforge", "cpu"],
                         "transformers_cpu": v["transformers", "cpu"],
                         "ratio_cpu": v["transformers", "cpu"] / v["lmforge", "cpu"],
                         "target": "", "met": None, "note": "",
                         "samples_ms": {f"{side} {c}": samples[side, context, part, c]
                                        for side in models for c in CLOCKS}})
    short, long = sizes["contexts"][0], sizes["contexts"][-1]
    for part, name in parts.items():
        g = {(side, c): ms[side, long, part, c] / ms[side, short, part, c]
             for side in models for c in CLOCKS}
        flat = part == "linear"
        rows.append({"section": "decode step", "case": f"{name}: growth {long}/{short}",
                     "unit": "x", "lmforge": g["lmforge", "wall"],
                     "transformers": g["transformers", "wall"], "ratio": None,
                     "lmforge_cpu": g["lmforge", "cpu"],
                     "transformers_cpu": g["transformers", "cpu"], "ratio_cpu": None,
                     "target": f"<= {FLAT_TARGET} (flat)" if flat else "",
                     "met": g["lmforge", "wall"] <= FLAT_TARGET if flat else None,
                     "note": ""})
    return rows


# ---------------------------------------------------------------------- the driver

def device_line() -> str:
    import transformers

    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import fla  # noqa: F401
        fla_state = "flash-linear-attention installed"
    except ImportError:
        fla_state = "no flash-linear-attention (transformers' torch path)"
    import lmforge

    source = Path(lmforge.__file__).parents[1]
    return (f"CPU {name}, {os.cpu_count()} cores, {torch.get_num_threads()} threads; "
            f"torch {torch.__version__}, transformers {transformers.__version__}; {fla_state}; "
            f"lmforge from {source}")


def describe(shape: dict) -> str:
    s = shape
    return (f"Qwen3.5 text, fp32, {s['num_hidden_layers']} layers (3 linear : 1 full), "
            f"hidden {s['hidden_size']}, MLP {s['intermediate_size']}, vocab "
            f"{s['vocab_size']}; full: {s['num_attention_heads']} heads, "
            f"{s['num_key_value_heads']} kv, head_dim {s['head_dim']}; linear: "
            f"{s['linear_num_key_heads']} key / {s['linear_num_value_heads']} value heads "
            f"of {s['linear_key_head_dim']} / {s['linear_value_head_dim']}")


def table(rows: list[dict]) -> str:
    """Each value as wall / CPU time; the ratio: lmforge's speed over transformers'."""
    out = ["| section | case | unit | lmforge (wall / CPU) | transformers (wall / CPU) "
           "| speed ratio, wall | speed ratio, CPU | target | met | note |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratios = ["" if x is None else f"{x:.2f}x" for x in (r["ratio"], r["ratio_cpu"])]
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        out.append(f"| {r['section']} | {r['case']} | {r['unit']} | {r['lmforge']:.3g} / "
                   f"{r['lmforge_cpu']:.3g} | {r['transformers']:.3g} / "
                   f"{r['transformers_cpu']:.3g} | {ratios[0]} | {ratios[1]} | {r['target']} "
                   f"| {met} | {r['note']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per side")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds; the test's)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--only", default="train,decode,step",
                   help="the sections to run, by commas (train, decode, step)")
    p.add_argument("--out", default=None, help="also write the rows here (JSON)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds: {a.rounds} must be >= 1")
    torch.set_num_threads(a.threads)
    shape, sizes = (QUICK_SHAPE, QUICK_SIZES) if a.quick else (FULL_SHAPE, FULL_SIZES)
    sections = set(a.only.split(","))
    head = [device_line(), describe(shape) + f"; each side's best of {a.rounds} rounds, "
            f"after a warm-up"]
    print("\n".join(head), flush=True)
    vocab = shape["vocab_size"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_model(path, shape, max(sizes["seq"], sizes["contexts"][-1]) + 2 * sizes[
            "new_tokens"])
        if "train" in sections:
            rows += bench_train(path, sizes, vocab, a.rounds)
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        # the decoding models: fresh from the directory (the train step changed its own)
        models = {"lmforge": load_lmforge(path).eval(),
                  "transformers": load_transformers(path).eval()}
        if "decode" in sections:
            rows += bench_decode(models, sizes, vocab, a.rounds)
            print("\n".join(table(rows[-len(sizes["batches"]):]).splitlines()[2:]), flush=True)
        if "step" in sections:
            rows += bench_step_cost(models, sizes, vocab, a.rounds)
    print()
    print(table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps({"device": head[0], "model": head[1],
                                           "sizes": sizes, "rounds": a.rounds,
                                           "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
