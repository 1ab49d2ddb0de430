"""Greedy decoding speed: lmforge's batched decoder against transformers' ``generate``
on the same random model, each side in its own process, side by side in one run.

    python bench/generate.py [--batches 1,8] [--new-tokens 128] [--prompt-len 32]
                             [--threads N] [--compile] [--json FILE]
    python bench/generate.py --preset qwen3-30b-a3b --dim 512 --layers 4 --heads 8 \
        --kv-heads 4 --experts 64 --top-k 8 --moe-ffn 256 --vocab 32000 --batches 1,8

The default model has SmolLM2-135M's shape (Llama, 30 layers, dim 576, 9 heads, 3 kv
heads, FFN 1536, vocabulary 49,152, tied embeddings) with random weights, fp32, saved
once to a temporary directory that both sides load. Every row of a batch has the same
prompt length (transformers' batch then needs no padding). Each side decodes once to
warm up, then the timed decode: ``--new-tokens`` greedy tokens per row, no early stop.
transformers runs with its static cache (``cache_implementation="static"``) where the
installed version supports it, else its dynamic cache; the table says which. The table:
new tokens per second over the whole batch, and lmforge's over transformers'. Both sides
must produce the same tokens (fp32 greedy); the count of differing tokens is printed.

``--preset`` names any family's preset instead (a mixture of experts: Qwen3-MoE,
Mixtral, ...), shaped by the overrides ``--dim --layers --heads --kv-heads --head-dim
--ffn --vocab --experts --top-k --moe-ffn --dense-layers`` (``bench/moe_bench.py``), with
lmforge's random initialisation written once for both sides; transformers' experts run
as ``--reference-experts`` says (grouped_mm, its fastest, by default).

Run it on a quiet machine: the figures depend on every core being free.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import moe_bench  # noqa: E402

SMOLLM2_135M = dict(layers=30, dim=576, heads=9, kv_heads=3, ffn=1536, vocab=49152)


def _save_model(path: Path, a) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=a.dim, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, intermediate_size=a.ffn, vocab_size=a.vocab,
        max_position_embeddings=max(2048, a.prompt_len + a.new_tokens),
        tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _write_model(path: Path, a) -> str:
    """The model both sides load, written to ``path``; ``a.vocab`` set to its vocabulary
    (the prompts'); returns its shape in words."""
    if a.preset is None:
        given = [f for f in moe_bench.SHAPE_FLAGS if f not in SMOLLM2_135M
                 and getattr(a, f) is not None] + (["dense_layers"] if a.dense_layers
                                                     is not None else [])
        if given:
            raise SystemExit(f"--{given[0].replace('_', '-')} needs --preset (the default "
                             f"model is a Llama)")
        for name, value in SMOLLM2_135M.items():
            setattr(a, name, value if getattr(a, name) is None else getattr(a, name))
        _save_model(path, a)
        return (f"{a.layers} layers, dim {a.dim}, {a.heads} heads, {a.kv_heads} kv, "
                f"ffn {a.ffn}, vocab {a.vocab}")
    args = moe_bench.model_args(a.preset, a, a.prompt_len + a.new_tokens)
    moe_bench.write_weights(args, path)
    a.vocab = args.vocab_size
    if not moe_bench.is_moe(args):
        return f"{a.preset} ({args.family}), vocab {args.vocab_size}"
    a.reference_experts = a.reference_experts or "grouped_mm"
    return (f"{moe_bench.describe(args)}; transformers' experts_implementation="
            f"{a.reference_experts}")


def _differing(ours: list[list[int]], theirs: list[list[int]]) -> int:
    """Token positions where the two sides' greedy ids differ (rows of equal length)."""
    return sum(x != y for a, b in zip(ours, theirs) for x, y in zip(a, b)) + sum(
        abs(len(a) - len(b)) for a, b in zip(ours, theirs))


def _prompts(batch: int, length: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, length), generator=g)


def _worker(a) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    prompts = _prompts(a.batch, a.prompt_len, a.vocab)
    if a.worker == "lmforge":
        from lmforge.models.generate import generate
        from lmforge.models.hf import load_hf_model

        model = load_hf_model(a.model_dir).eval()
        rows = prompts.tolist()

        def run(new: int) -> list[list[int]]:
            return [c.ids for c in generate(model, rows, new, compile=a.compile)]
        cache = "static, compiled step" if a.compile else "one cache per batch (eager)"
    else:
        import transformers

        experts = ({"experts_implementation": a.reference_experts}
                   if a.reference_experts else {})
        model = transformers.AutoModelForCausalLM.from_pretrained(
            a.model_dir, dtype=torch.float32, **experts).eval()
        if a.reference_experts and model.config._experts_implementation != a.reference_experts:
            raise SystemExit(f"transformers chose experts_implementation="
                             f"{model.config._experts_implementation!r}")
        cache = "static"

        def run(new: int) -> list[list[int]]:
            kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0)
            if cache == "static":
                kwargs["cache_implementation"] = "static"
            with torch.no_grad():
                out = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                     **kwargs)
            return out[:, prompts.shape[1]:].tolist()
        try:
            run(2)
        except Exception as e:  # an older transformers without a static cache for this model
            print(f"transformers: static cache unavailable ({e}); dynamic cache",
                  file=sys.stderr)
            cache = "dynamic"
    run(min(8, a.new_tokens))  # warm-up (and, with --compile, the compilation)
    began = time.perf_counter()
    tokens = run(a.new_tokens)
    seconds = time.perf_counter() - began
    return {"side": a.worker, "batch": a.batch, "cache": cache, "seconds": seconds,
            "tokens_per_s": a.batch * a.new_tokens / seconds, "tokens": tokens}


def _side(a, side: str, batch: int, model_dir: Path) -> dict:
    argv = [sys.executable, __file__, "--worker", side, "--batch", str(batch),
            "--model-dir", str(model_dir), "--threads", str(a.threads),
            "--new-tokens", str(a.new_tokens), "--prompt-len", str(a.prompt_len),
            "--vocab", str(a.vocab)] + (["--compile"] if a.compile else []) + (
               ["--reference-experts", a.reference_experts] if a.reference_experts else [])
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{side} at batch {batch} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None,
                   help="any family's preset, shaped by the overrides (default: a "
                        "SmolLM2-135M-shaped Llama)")
    p.add_argument("--reference-experts", default=None,
                   choices=moe_bench.EXPERTS_IMPLEMENTATIONS,
                   help="an MoE reference's experts_implementation (default grouped_mm)")
    moe_bench.add_shape_flags(p)
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--compile", action="store_true", help="lmforge's compiled decode step")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", choices=("lmforge", "transformers"), help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(_worker(a)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shape = _write_model(Path(tmp), a)
        for batch in [int(b) for b in a.batches.split(",")]:
            ours, theirs = (_side(a, s, batch, Path(tmp)) for s in ("lmforge", "transformers"))
            differ = _differing(ours.pop("tokens"), theirs.pop("tokens"))
            rows.append({"batch": batch, "lmforge": ours, "transformers": theirs,
                         "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
                         "same_tokens": differ == 0, "tokens_differing": differ})
    shape += (f"; prompt {a.prompt_len}, {a.new_tokens} new tokens, fp32, "
              f"{a.threads} threads")
    print(f"greedy decoding, {shape}")
    print(f"{'batch':>5}  {'lmforge tok/s':>13}  {'transformers tok/s':>18}  {'ratio':>5}  "
          f"transformers cache  same tokens")
    for r in rows:
        same = "yes" if r["same_tokens"] else (
            f"NO: {r['tokens_differing']} of {r['batch'] * a.new_tokens} differ")
        print(f"{r['batch']:>5}  {r['lmforge']['tokens_per_s']:>13.1f}  "
              f"{r['transformers']['tokens_per_s']:>18.1f}  {r['ratio']:>5.2f}  "
              f"{r['transformers']['cache']:<18}  {same}")
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
