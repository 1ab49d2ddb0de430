"""Training-step speed and memory of lmforge against Hugging Face transformers (+ peft),
same shapes, dtype policy and batch, back to back in one invocation.

    python bench/train_step.py --preset tiny --device cpu
    python bench/train_step.py --preset llama3.2-1b --seq-len 2048 --batch 1 --device cuda
    python bench/train_step.py --preset llama2-7b --method qlora --seq-len 2048 --batch 4
    python bench/train_step.py --preset llama3.2-1b --seq-len 2048 --batch 16,8,4,2,1 \
        --compile --fused-loss --reference-compile     # each side at its largest that fits

Each side runs in its own child process, so its peak memory is its own: on CUDA the
allocator's peak (torch.cuda.max_memory_allocated), on CPU the child's peak resident
set. Steps are timed after warm-up, synchronised with the device, and the median is
reported. ``--batch`` may list micro-batches: each side then times the largest that fits
its device (tried largest first in its own process; an out-of-memory step moves to the
next), which the table names. Weights are random (no download). The reference is LlamaForCausalLM with SDPA
attention and torch.optim.AdamW; for lora/qlora, peft's LoRA on the same modules
(qlora's reference: the base's projections as bitsandbytes NF4 Linear4bit with double
quantization and bf16 compute, QLoRA's setting; it needs bitsandbytes).

A mixture of experts (any family's MoE preset, shaped by the overrides ``--dim --layers
--heads --kv-heads --head-dim --ffn --vocab --experts --top-k --moe-ffn --dense-layers``,
which any preset takes) is compared with transformers' model of the same config.json,
its experts as ``--reference-experts`` says (grouped_mm, transformers 5's fastest, by
default), from the same random weights: written once (``save_hf_model``) and loaded by
both sides (``--random-weights``: each side initialises its own, for a model too large
to write, such as Qwen3-30B-A3B on a GPU). lmforge's loss is the trainer's (cross-entropy
+ router_aux_loss_coef x the balance loss, ``ExpertBalance``), transformers' the same
with ``output_router_logits=True``; both first-step losses are printed with their
difference. LoRA (``--method lora``) adapts the attention and the experts on both sides
(peft: ``target_modules`` and ``target_parameters``). See ``bench/moe_bench.py``.

    python bench/train_step.py --preset qwen3-30b-a3b --dim 512 --layers 4 --heads 8 \
        --kv-heads 4 --experts 64 --top-k 8 --moe-ffn 256 --vocab 32000 --seq-len 512 \
        --batch 1 --device cpu
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # (moe_bench, when imported)

import moe_bench  # noqa: E402

from lmforge.config import resolve_device  # noqa: E402
from lmforge.models.llama import FAMILY, LlamaArgs, build_llama, materialize  # noqa: E402
from lmforge.models.presets import PRESETS  # noqa: E402
from lmforge.perf.flops import device_peak_flops, flops_per_token  # noqa: E402
from lmforge.train import metrics as M  # noqa: E402

LORA_TARGETS = list(FAMILY.projections.all)  # all seven, on both sides of the comparison
QUANTIZE = {"qlora": "nf4", "lora-int8": "int8"}  # --method: lmforge's lora.quantize


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--method", default="full", choices=("full", "lora", "qlora", "lora-int8"),
                   help="lora-int8: LoRA on an int8 base (lmforge's lora.quantize=int8; the "
                        "reference: bitsandbytes' LLM.int8 Linear8bitLt, as load_in_8bit)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=_batches, default=[4],
                   help="micro-batch, or several by commas: each side times the largest "
                        "that fits its device")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--compile", action="store_true", help="torch.compile lmforge's blocks")
    p.add_argument("--compile-whole", action="store_true",
                   help="torch.compile lmforge's whole model instead of each block (issue 40 "
                        "point 3: which pays is measured, not assumed)")
    p.add_argument("--adamw", choices=("default", "fused", "foreach"), default="default",
                   help="lmforge's AdamW kernel (default: fused on CUDA, as the trainer)")
    p.add_argument("--reference-compile", action="store_true",
                   help="torch.compile the reference model (whole) too")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--loss-chunk-tokens", type=int, default=0,
                   help="lmforge's train.loss_chunk_tokens (0: whole micro-batch logits)")
    p.add_argument("--fused-loss", action="store_true",
                   help="lmforge's train.fused_loss: the fused linear + cross-entropy over "
                        "chunks of --loss-chunk-tokens (0: 1024; bench/loss_heads.py)")
    p.add_argument("--low-memory", action="store_true",
                   help="full fine-tuning with bf16 weights on both sides; lmforge: bf16 "
                        "AdamW states with stochastic rounding, step fused into backward; "
                        "reference: torch AdamW on the bf16 weights after backward")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                   help="projections LoRA adapts on both sides, by commas (default: all "
                        "seven; peft's own default is q_proj,v_proj)")
    p.add_argument("--reference-experts", default="grouped_mm",
                   choices=moe_bench.EXPERTS_IMPLEMENTATIONS,
                   help="an MoE reference's experts_implementation")
    p.add_argument("--random-weights", action="store_true",
                   help="an MoE: each side initialises its own weights (no shared copy "
                        "written; the losses then differ)")
    p.add_argument("--base-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="an MoE under LoRA: bf16 stores lmforge's frozen projections and "
                        "experts in bf16 (the trainer's rule under bf16 compute) and builds "
                        "the reference in bf16")
    p.add_argument("--lmforge-only", action="store_true",
                   help="time lmforge's side alone (comparing its own options)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--side", choices=("lmforge", "reference"), help=argparse.SUPPRESS)
    p.add_argument("--weights-dir", help=argparse.SUPPRESS)  # (an MoE's shared weights)
    moe_bench.add_shape_flags(p)
    return p.parse_args(argv)


def _batches(text: str) -> list[int]:
    """``--batch``: one micro-batch or several by commas, largest first."""
    try:
        values = sorted({int(v) for v in text.split(",")}, reverse=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers by commas, got {text!r}")
    if not values or values[-1] < 1:
        raise argparse.ArgumentTypeError(f"micro-batches must be >= 1, got {text!r}")
    return values


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ------------------------------------------------------------------------ the two sides

def build_lmforge(args, model_args: LlamaArgs, device):
    from lmforge.config import JobConfig
    from lmforge.parallel.mesh import ParallelDims
    from lmforge.parallel.parallelize import apply_model_parallel

    if moe_bench.is_moe(model_args):
        return build_lmforge_moe(args, model_args, device)
    torch.manual_seed(0)
    model = build_llama(model_args)
    cfg = JobConfig()
    cfg.train.compile = args.compile
    cfg.train.activation_checkpointing = "full" if args.activation_checkpointing else "none"
    if args.method != "full":
        from lmforge.config import LoraConfig
        from lmforge.peft import lora as L

        lcfg = LoraConfig(enabled=True, rank=args.lora_rank, alpha=2 * args.lora_rank,
                          targets=args.lora_targets.split(","),
                          quantize=QUANTIZE.get(args.method))
        L.prepare_model_for_lora(model, lcfg)
        materialize(model, device)
        L.after_materialize(model, lcfg)
    else:
        materialize(model, device)
    apply_model_parallel(model, ParallelDims(), cfg)
    model.fused_loss = args.fused_loss  # (as build_train_model sets train.fused_loss)
    from lmforge.models.loss import micro_batch_loss_sum

    forward = _whole_compiled(model) if args.compile_whole else model

    def step(ids, labels):
        batch = {"input_ids": ids, "labels": labels}
        loss = micro_batch_loss_sum(forward, batch, device, lambda: autocast(device),
                                    args.loss_chunk_tokens) / labels.numel()
        loss.backward()
        return loss

    return model, step


def build_lmforge_moe(args, model_args, device):
    """An MoE as the trainer builds and steps it (``moe_bench``)."""
    from lmforge.config import JobConfig
    from lmforge.parallel.mesh import ParallelDims
    from lmforge.parallel.parallelize import apply_model_parallel

    lora = None
    if args.method == "lora":
        from lmforge.config import LoraConfig

        lora = LoraConfig(enabled=True, rank=args.lora_rank, alpha=2 * args.lora_rank,
                          targets=args.lora_targets.split(","))
    elif args.method != "full":
        raise SystemExit(f"--method {args.method}: an MoE bench takes full or lora")
    if args.base_dtype == "bf16" and (device.type != "cuda" or lora is None):
        raise SystemExit("--base-dtype bf16: a frozen base under LoRA on a GPU (bf16 "
                         "autocast); the CPU computes in fp32")
    model = moe_bench.lmforge_model(model_args, device, args.weights_dir, lora,
                                    frozen_bf16=args.base_dtype == "bf16")
    cfg = JobConfig()
    cfg.train.compile = args.compile
    cfg.train.activation_checkpointing = "full" if args.activation_checkpointing else "none"
    apply_model_parallel(model, ParallelDims(), cfg)
    model.fused_loss = args.fused_loss
    forward = _whole_compiled(model) if args.compile_whole else model
    return model, moe_bench.lmforge_moe_step(forward, device, lambda: autocast(device),
                                             args.loss_chunk_tokens)


def _whole_compiled(model):
    """The model compiled as one graph, its attributes (args, output, fused_loss) still
    read from the model itself, as the loss functions read them."""
    compiled = torch.compile(model)
    compiled.fused_loss = model.fused_loss
    return compiled


def build_reference(args, model_args: LlamaArgs, device):
    import transformers

    from lmforge.models.hf import hf_config_from_args

    if moe_bench.is_moe(model_args):
        return build_reference_moe(args, model_args, device)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**hf_config_from_args(model_args))
    config._attn_implementation = "sdpa"
    # QLoRA's unquantized parts and the low-memory weights are bf16; otherwise fp32 weights
    # under bf16 autocast, as lmforge's side
    bf16 = args.method in QUANTIZE or args.low_memory
    model = _hf_llama_on(transformers, config, device, torch.bfloat16 if bf16 else torch.float32)
    if args.method == "qlora":
        quantize_reference_4bit(model, LORA_TARGETS)
    elif args.method == "lora-int8":
        quantize_reference_8bit(model)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
        if args.method != "full":  # frozen embeddings: checkpointed blocks need an input
            model.enable_input_require_grads()  # that requires grad, as peft recipes do
    if args.method != "full":
        import peft

        targets = args.lora_targets.split(",")  # (peft takes all-linear as a string only)
        lcfg = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                               target_modules="all-linear" if targets == ["all-linear"]
                               else targets, lora_dropout=0.0)
        model = peft.get_peft_model(model, lcfg)
    forward = torch.compile(model) if args.reference_compile else model

    def step(ids, labels):
        with autocast(device):
            logits = forward(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()
        loss.backward()
        return loss

    return model, step


def build_reference_moe(args, model_args, device):
    """transformers' model of the same config.json and weights, experts as
    ``--reference-experts``; peft's LoRA on the attention (target_modules) and the
    experts (target_parameters)."""
    from lmforge.models.registry import family_of

    if args.method not in ("full", "lora"):
        raise SystemExit(f"--method {args.method}: an MoE bench takes full or lora")
    dtype = torch.bfloat16 if args.base_dtype == "bf16" else torch.float32
    model = moe_bench.reference_model(model_args, device, args.weights_dir,
                                      args.reference_experts, dtype)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable()
        if args.method != "full":
            model.enable_input_require_grads()
    if args.method == "lora":
        attention = family_of(model_args).projections.attention
        targets = [t.strip().lower() for t in args.lora_targets.split(",")]
        every = "all-linear" in targets or "all_linear" in targets
        experts = every or bool(set(targets) & set(moe_bench.EXPERT_TARGETS))
        model = moe_bench.reference_lora(
            model, args.lora_rank, [t for t in attention if every or t in targets], experts)
    forward = torch.compile(model) if args.reference_compile else model
    return model, moe_bench.reference_moe_step(forward, model_args.router_aux_loss_coef,
                                               lambda: autocast(device))


def _hf_llama_on(transformers, config, device, dtype):
    """Built on the device in ``dtype`` directly, as ``from_pretrained(dtype=...,
    device_map=...)`` would place it: a 7B model is never built on the host first."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def quantize_reference_4bit(model, targets) -> None:
    """QLoRA's base as bitsandbytes holds it, as transformers' ``BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=bf16)`` loads it: each target projection becomes a Linear4bit
    (NF4 codes, double-quantized scales), quantized where its weight lies."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise RuntimeError("the qlora reference needs bitsandbytes, not installed here "
                           "(docs/benchmarks.md: how its wheel travels to a GPU machine)"
                           ) from None

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name not in targets or not isinstance(child, torch.nn.Linear):
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                  bias=child.bias is not None, compute_dtype=torch.bfloat16,
                                  compress_statistics=True, quant_type="nf4", device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                         compress_statistics=True, quant_type="nf4",
                                         module=q).to(child.weight.device)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, name, q)


def quantize_reference_8bit(model) -> None:
    """An int8 base as transformers' ``load_in_8bit=True`` holds it: each linear layer of
    the blocks (the head stays bf16, as transformers skips it) becomes bitsandbytes'
    LLM.int8 Linear8bitLt (threshold 6.0, no fp16 copy kept), quantized as it moves to
    the GPU."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise RuntimeError("the lora-int8 reference needs bitsandbytes, not installed here "
                           "(docs/benchmarks.md: how its wheel travels to a GPU machine)"
                           ) from None

    for module in list(model.model.layers.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, torch.nn.Linear):
                continue
            device = child.weight.device
            q = bnb.nn.Linear8bitLt(child.in_features, child.out_features,
                                    bias=child.bias is not None, has_fp16_weights=False,
                                    threshold=6.0, device="meta")
            # (Int8Params quantizes on its move from the host to the GPU)
            q.weight = bnb.nn.Int8Params(child.weight.data.cpu(), requires_grad=False,
                                         has_fp16_weights=False)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data.cpu(), requires_grad=False)
            setattr(module, name, q.to(device))


def run_side(args) -> dict:
    device = resolve_device(args.device, "--device")
    model_args = moe_bench.model_args(args.preset, args, args.seq_len)
    build = build_lmforge if args.side == "lmforge" else build_reference
    model, step = build(args, model_args, device)
    if args.low_memory:
        if args.method != "full":
            raise SystemExit("--low-memory is for --method full")
        model.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(args, params, device)
    for batch in args.batch:  # (largest first: the first that fits is timed)
        try:
            times, losses = timed_steps(args, model_args, step, optimizer, batch, device)
            break
        except torch.OutOfMemoryError:
            if batch == args.batch[-1]:
                raise
            free_after_oom(params, optimizer, device)
    seconds = statistics.median(times)
    tokens_per_s = batch * args.seq_len / seconds
    flops = flops_per_token(model_args, args.seq_len)
    peak = device_peak_flops(device)
    return {"side": args.side, "batch": batch, "step_s": seconds, "tokens_per_s": tokens_per_s,
            "tflops": tokens_per_s * flops / 1e12,
            "mfu": tokens_per_s * flops / peak if peak else None,
            "peak_mem_gib": M.peak_memory_gib(device),
            "trainable": sum(p.numel() for p in params), "losses": losses,
            **({"experts_implementation": model.config._experts_implementation}
               if args.side == "reference" and moe_bench.is_moe(model_args) else {})}


def timed_steps(args, model_args, step, optimizer, batch: int,
                device) -> tuple[list[float], list[float]]:
    """Warm-up, then the timed steps' seconds, at micro-batch ``batch``; and every step's
    loss (the first before any update: both sides' match when their weights do)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model_args.vocab_size, (batch, args.seq_len + 1), generator=g)
    ids = ids.to(device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        _sync(device)
        start = time.perf_counter()
        loss = step(inputs, labels)
        if optimizer is not None:  # (None: each parameter was updated in backward)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach() if torch.is_tensor(loss) else loss))
    return times, losses


def free_after_oom(params: list, optimizer, device) -> None:
    """What a failed step left: gradients, optimizer states, the allocator's cache."""
    import gc

    for p in params:
        p.grad = None
    if optimizer is not None:
        optimizer.state.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_optimizer(args, params: list, device: torch.device):
    if args.low_memory and args.side == "lmforge":
        from lmforge.train.low_memory import AdamWBF16, fuse_step_into_backward

        fuse_step_into_backward(AdamWBF16(params, lr=1e-5))
        return None
    fused = device.type == "cuda" and args.side == "lmforge"
    if args.side == "lmforge" and args.adamw != "default":
        fused = args.adamw == "fused"
        return torch.optim.AdamW(params, lr=1e-5, fused=fused or None, foreach=not fused)
    return torch.optim.AdamW(params, lr=1e-5, fused=fused or None)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- driver

def run_child(argv: list[str], side: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--side", side]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"side": side, "error": proc.stderr.strip().splitlines()[-1]
                if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.side:
        print(json.dumps(run_side(args)))
        return 0
    device = resolve_device(args.device, "--device")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    method = args.method + (" (low-memory: bf16 weights and states)" if args.low_memory else "")
    batch = ",".join(map(str, args.batch))
    model_args = moe_bench.model_args(args.preset, args, args.seq_len)
    print(f"{args.preset} {method}, seq {args.seq_len}, micro-batch {batch}, "
          f"{args.steps} timed steps after {args.warmup} warm-up, on {name}")
    sides = ("lmforge",) if args.lmforge_only else ("lmforge", "reference")
    moe = moe_bench.is_moe(model_args)
    if moe:
        print(f"{moe_bench.describe(model_args)}; reference experts_implementation="
              f"{args.reference_experts}; weights: "
              + ("each side its own" if args.random_weights or args.weights_dir
                 else "one random set, shared"))
    if moe and not args.random_weights and not args.weights_dir:
        with tempfile.TemporaryDirectory() as tmp:
            moe_bench.write_weights(model_args, Path(tmp) / "model")
            shared = [*argv, "--weights-dir", str(Path(tmp) / "model")]
            results = [run_child(shared, side) for side in sides]
    else:
        results = [run_child(argv, side) for side in sides]
    print(format_table(results))
    ours, ref = results[0], results[-1]
    if len(results) == 2 and "error" not in ours and "error" not in ref:
        print(f"speed ratio lmforge/reference: {ours['tokens_per_s'] / ref['tokens_per_s']:.2f}x"
              f"   peak memory ratio: {ours['peak_mem_gib'] / ref['peak_mem_gib']:.2f}")
        if moe:
            print(loss_line(ours, ref, shared=not (args.random_weights or args.weights_dir)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": name,
                                               "results": results}, indent=2))
    return 0 if "error" not in ours else 1


def loss_line(ours: dict, ref: dict, shared: bool) -> str:
    """Both sides' first-step loss (before any update) and their difference."""
    a, b = ours["losses"][0], ref["losses"][0]
    note = "" if shared else " (different random weights: not comparable)"
    return (f"first-step loss (cross-entropy + router_aux_loss_coef x aux): lmforge {a:.6f}, "
            f"reference {b:.6f}, |difference| {abs(a - b):.2e}{note}")


def format_table(results: list[dict]) -> str:
    rows = ["| side | micro-batch | tokens/s | TFLOP/s | MFU | peak mem (GiB) | trainable params |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['side']} | | n/a ({r['error']}) | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (CPU)"
        rows.append(f"| {r['side']} | {r['batch']} | {r['tokens_per_s']:.0f} | "
                    f"{r['tflops']:.3f} | {mfu} | "
                    f"{r['peak_mem_gib']:.2f} | {r['trainable']:,} |")
    return "\n".join(rows)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU ({line.split(':', 1)[1].strip()}, {os.cpu_count()} cores)"
    except OSError:
        pass
    return f"CPU ({os.cpu_count()} cores)"


if __name__ == "__main__":
    sys.exit(main())
