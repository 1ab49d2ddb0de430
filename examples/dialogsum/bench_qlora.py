"""Training-step time and weight memory of LoRA vs QLoRA (NF4, int8) on one model.

Same model, same adapters (all seven projections), same batch; only the frozen base's
storage differs. Prints one line per variant and the QLoRA/LoRA time ratio.

Usage: python examples/dialogsum/bench_qlora.py [--dim 1024 --layers 4 --seq 256
       --batch 4 --steps 6 --threads 1 --device cpu]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lmforge.config import LoraConfig, OptimConfig
from lmforge.models.llama import LlamaArgs, build_llama, materialize
from lmforge.peft import after_materialize, prepare_model_for_lora, trainable_summary
from lmforge.peft.quant import quantized_bytes
from lmforge.train.optim import build_optimizer


def step_time(args, quantize):
    margs = LlamaArgs(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                      n_kv_heads=args.dim // 128, vocab_size=4096,
                      ffn_dim=int(args.dim * 8 / 3) // 64 * 64, max_seq_len=args.seq)
    cfg = LoraConfig(enabled=True, rank=16, alpha=32, targets="all-linear",
                     quantize=quantize)
    torch.manual_seed(0)
    model = build_llama(margs)
    prepare_model_for_lora(model, cfg)
    materialize(model, args.device)
    after_materialize(model, cfg)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
    tokens = torch.randint(0, 4096, (args.batch, args.seq + 1), device=args.device)
    times = []
    for _ in range(args.steps + 2):  # two warm-up steps
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    base_bytes = sum(m.weight.numel() * m.weight.element_size() for name, m in
                     model.named_modules() if name.endswith("_proj") and
                     getattr(m, "weight", None) is not None) + quantized_bytes(model)
    return sorted(times[2:])[len(times[2:]) // 2], base_bytes, trainable_summary(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for quantize in (None, "nf4", "int8"):
        seconds, nbytes, summary = step_time(args, quantize)
        results[quantize] = seconds
        print(f"{quantize or 'lora (fp32 base)':18s} median step {seconds:.3f} s   "
              f"projection weights {nbytes / 2**20:7.1f} MiB   {summary}", flush=True)
    for q in ("nf4", "int8"):
        print(f"{q} / lora step time: {results[q] / results[None]:.2f}x")


if __name__ == "__main__":
    main()
