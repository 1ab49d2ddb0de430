"""Greedy decoding speed: lmforge's batched decoder against transformers' ``generate``
on the same random model, each side in its own process, side by side in one run.

    python bench/generate.py [--batches 1,8] [--new-tokens 128] [--prompt-len 32]
                             [--threads N] [--compile] [--json FILE]

The default model has SmolLM2-135M's shape (Llama, 30 layers, dim 576, 9 heads, 3 kv
heads, FFN 1536, vocabulary 49,152, tied embeddings) with random weights, fp32, saved
once to a temporary directory that both sides load. Every row of a batch has the same
prompt length (transformers' batch then needs no padding). Each side decodes once to
warm up, then the timed decode: ``--new-tokens`` greedy tokens per row, no early stop.
transformers runs with its static cache (``cache_implementation="static"``) where the
installed version supports it, else its dynamic cache; the table says which. The table:
new tokens per second over the whole batch, and lmforge's over transformers'. Both sides
must produce the same tokens (fp32 greedy); a difference is printed.

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

        model = transformers.AutoModelForCausalLM.from_pretrained(
            a.model_dir, dtype=torch.float32).eval()
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
            "--vocab", str(a.vocab)] + (["--compile"] if a.compile else [])
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{side} at batch {batch} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in SMOLLM2_135M.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
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
        _save_model(Path(tmp), a)
        for batch in [int(b) for b in a.batches.split(",")]:
            ours, theirs = (_side(a, s, batch, Path(tmp)) for s in ("lmforge", "transformers"))
            same = ours.pop("tokens") == theirs.pop("tokens")
            rows.append({"batch": batch, "lmforge": ours, "transformers": theirs,
                         "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
                         "same_tokens": same})
    shape = (f"{a.layers} layers, dim {a.dim}, {a.heads} heads, {a.kv_heads} kv, ffn {a.ffn}, "
             f"vocab {a.vocab}; prompt {a.prompt_len}, {a.new_tokens} new tokens, fp32, "
             f"{a.threads} threads")
    print(f"greedy decoding, {shape}")
    print(f"{'batch':>5}  {'lmforge tok/s':>13}  {'transformers tok/s':>18}  {'ratio':>5}  "
          f"transformers cache  same tokens")
    for r in rows:
        print(f"{r['batch']:>5}  {r['lmforge']['tokens_per_s']:>13.1f}  "
              f"{r['transformers']['tokens_per_s']:>18.1f}  {r['ratio']:>5.2f}  "
              f"{r['transformers']['cache']:<18}  {'yes' if r['same_tokens'] else 'NO'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
