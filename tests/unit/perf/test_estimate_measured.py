"""The memory estimate against the peak measured on a real CPU training step.

For a matrix of tiny configs (full / LoRA / QLoRA, with and without activation
checkpointing, full or selective, micro-batch 1 and 4, fp32 and bf16 autocast; a Llama, a
Qwen3 for its q/k norms, and a GPT-J for its LayerNorm, parallel block, partial rotary and
biased GELU MLP) the step runs through
lmforge's own code (model, LoRA swap, checkpointing, optimizer, accumulate_gradients),
and TensorMemoryTracker records the peak of live tensor storage over the second step (the
first creates the optimizer state). The estimate of the same quantity (peak allocated,
without the framework overhead) must fall within +-15% (docs/estimate.md)."""
import contextlib
import copy
import dataclasses
import functools

import pytest
import torch

from helpers.tiny_models import tiny_llama_args
from lmforge import IGNORE_INDEX
from lmforge.config import JobConfig
from lmforge.models.preference import PreferenceParams
from lmforge.models.common import materialize
from lmforge.models.grouped_mm import grouped_mm_supported
from lmforge.models.deepseek_v3.presets import PRESETS as DEEPSEEK_V3
from lmforge.models.gemma3.model import Gemma3Args
from lmforge.models.phi3.model import Phi3Args
from lmforge.models.qwen3_moe.model import SparseArgs
from lmforge.models.registry import PRESETS, build_model
from lmforge.parallel.parallelize import checkpoint_forward, checkpointed_block
from lmforge.peft.lora import after_materialize, prepare_model_for_lora
from lmforge.perf.estimate import estimate_memory
from lmforge.perf.estimate_setup import Setup, setup_from_config
from lmforge.perf.flops import Trainability
from lmforge.perf.tracker import TensorMemoryTracker
from lmforge.peft.targets import LoraSpec
from lmforge.train.optim import Optimizers
from lmforge.train.precision import LossScaler
from lmforge.train.model_setup import frozen_linears_to_bf16
from lmforge.train.objectives import NEXT_TOKEN
from lmforge.train.preference import Preference
from lmforge.train.balance import ExpertBalance
from lmforge.train.step import accumulate_gradients

TOLERANCE = 0.15
ARGS = tiny_llama_args(dim=64, vocab_size=256, ffn_dim=176, max_seq_len=128)
# gptj-tiny (dim 64, 4 heads, ffn 256, rotary on 8 of 16 head features) at the same size
# Qwen3: an RMSNorm over each q and k head, heads sized apart from dim (4 x 24 != 64)
TINY = {"llama": ARGS, "gptj": dataclasses.replace(PRESETS["gptj-tiny"], n_layers=2,
                                                     vocab_size=256, max_seq_len=128),
        "qwen3": dataclasses.replace(ARGS, family="qwen3", qk_norm=True, explicit_head_dim=24)}
TINY["qwen3 without q/k norms"] = dataclasses.replace(TINY["qwen3"], qk_norm=False)
# Phi-3: fused qkv_proj and gate_up_proj, rotary on half of each head (Phi-4-mini's shape)
TINY["phi3"] = Phi3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                        ffn_dim=176, max_seq_len=128, partial_rotary_factor=0.5)
# Gemma 3: four norms per block, q/k norms, GeGLU, a sliding layer and a global one
TINY["gemma3"] = Gemma3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                            ffn_dim=176, explicit_head_dim=24, max_seq_len=128,
                            sliding_window=16, sliding_pattern=2)
# Qwen3-MoE: 8 experts of width 32, top 2, every layer sparse (the grouped product, the
# router's fp32 logits kept for the load-balancing loss, LoRA folded into the stacks)
TINY["qwen3_moe"] = SparseArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                               ffn_dim=176, max_seq_len=128, qk_norm=True,
                               explicit_head_dim=24, n_experts=8, top_k=2, moe_ffn_dim=32,
                               dense_layers=())
TINY["qwen3_moe, dense layer 0"] = dataclasses.replace(TINY["qwen3_moe"], dense_layers=(0,))
# DeepSeek-V3's debug size: multi-head latent attention (query and kv latents with their
# norms, a rotary key shared by the heads), layer 0 dense, then sigmoid-routed experts
# with a shared one
TINY["deepseek_v3"] = dataclasses.replace(DEEPSEEK_V3["deepseek-v3-debug"], max_seq_len=128)
# Qwen3.5's debug size (4 layers: three Gated DeltaNet, one gated full attention) and one
# with wider linear layers (4 key and 8 value heads of 32)
TINY["qwen3_5"] = PRESETS["qwen3.5-debug"]
TINY["qwen3_5 wide"] = dataclasses.replace(PRESETS["qwen3.5-debug"], linear_key_heads=4,
                                           linear_value_heads=8, linear_key_head_dim=32,
                                           linear_value_head_dim=32)
# the hybrid MoEs' debug sizes: Qwen3.5's layers with experts and a gated shared expert
for _name in ("qwen3-next-debug", "qwen3.5-moe-debug"):
    TINY[_name] = dataclasses.replace(PRESETS[_name], max_seq_len=128)
SEQ = 64


@functools.lru_cache(maxsize=None)
def measure_step(lora: bool, ckpt: bool, micro_batch: int, bf16: bool = False,
                 quantize=None, dropout: float = 0.0, targets=("q_proj", "v_proj"),
                 loss_chunk: int = 0, vocab: int = ARGS.vocab_size, low_memory: bool = False,
                 family: str = "llama", fp16: bool = False, every: int = 2,
                 layers: int = 2, dpo: bool = False, seq: int = SEQ):
    """(measured peak bytes of step 2, the Setup describing the same run). ``ckpt``:
    True (full), False (none) or "selective", which checkpoints blocks 0, ``every``, ...
    as the trainer does; ``low_memory``: bf16 weights, adamw_bf16, the step fused into
    backward (the trainer's low-memory path); ``family``: which tiny model of TINY, with
    ``layers`` blocks; ``fp16``: fp16 autocast with the loss scaler the trainer uses
    (frozen weights stay fp32); ``dpo``: ``micro_batch`` preference pairs (two rows each,
    labels on their last three quarters) with DPO's live reference, the adapters-off
    model under LoRA, else a frozen copy of the weights (tracked too); ``seq``: each
    row's tokens."""
    SEQ = seq  # noqa: N806 (the module's default, per call)
    mode = ckpt if isinstance(ckpt, str) else "full" if ckpt else "none"
    args = dataclasses.replace(TINY[family], vocab_size=vocab, n_layers=layers)
    torch.manual_seed(0)
    cfg = JobConfig()
    cfg.lora.enabled, cfg.lora.quantize = lora, quantize
    cfg.lora.dropout, cfg.lora.targets = dropout, list(targets)
    model = build_model(args)
    if lora:
        prepare_model_for_lora(model, cfg.lora)
    for layer in model.layers.values():
        if checkpointed_block(mode, every, int(layer.layer_id)):
            checkpoint_forward(layer)
    materialize(model, "cpu")
    if lora:
        after_materialize(model, cfg.lora)
        if bf16 and not quantize:  # as the trainer stores a frozen base under bf16
            frozen_linears_to_bf16(model)
    model.train()
    if low_memory:
        cfg.train.param_dtype, cfg.optim.name, cfg.optim.in_backward = "bf16", "adamw_bf16", True
        model.to(torch.bfloat16)
    optimizers = Optimizers([model], cfg.optim, max_steps=10,
                            scaler=LossScaler(enabled=fp16, init_scale=1024.0))
    optimizer = optimizers.optimizers[0]
    half = torch.bfloat16 if bf16 else torch.float16 if fp16 else None
    autocast = (functools.partial(torch.autocast, "cpu", dtype=half) if half
                else contextlib.nullcontext)
    ids = torch.randint(0, vocab, (micro_batch * (2 if dpo else 1), SEQ))
    batch = {"input_ids": ids, "labels": ids.clone()}
    objective, reference = NEXT_TOKEN, []
    if dpo:
        cfg.data.kind, cfg.data.path = "preference", "pairs.jsonl"
        batch["labels"][:, :SEQ // 4] = IGNORE_INDEX  # the prompts
        batch["slots"] = torch.arange(len(ids))[:, None].expand(-1, SEQ).clone()
        batch["n_pairs"] = micro_batch
        copy_ = None if lora else copy.deepcopy(model).requires_grad_(False)
        reference = [] if lora else list(copy_.parameters())
        objective = Preference("dpo", PreferenceParams(), "adapters_off" if lora else "model",
                               copy_)
    params = [p for p in model.parameters() if p.requires_grad]
    for dtype in (torch.float32, torch.bfloat16):  # its probe, run first inside a
        grouped_mm_supported("cpu", dtype)  # checkpointed block, upsets the recompute
    balance = ExpertBalance.of(model, 1)  # (an MoE's load-balancing loss; None if dense)

    def step():
        accumulate_gradients(model, [batch], torch.device("cpu"), autocast,
                             loss_chunk_tokens=loss_chunk, loss_scale=optimizers.scaler.scale,
                             objective=objective, balance=balance)
        optimizers.scaler.unscale(optimizers.optimizers)  # (a no-op without fp16)
        if not low_memory:  # (low memory: each parameter was stepped in backward)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizers.step()
        optimizers.zero_grad()

    step()  # creates the optimizer state
    tracker = TensorMemoryTracker()
    tracker.track(list(model.parameters()) + reference + [ids, batch["labels"]])
    tracker.track(t for state in optimizer.state.values() for t in state.values())
    with tracker:
        step()
    t = cfg.train
    cfg.data.seq_len, cfg.data.micro_batch_size = SEQ, micro_batch
    t.loss_chunk_tokens, t.dtype = loss_chunk, "bf16" if bf16 else "fp16" if fp16 else "fp32"
    t.activation_checkpointing, t.activation_checkpointing_every = mode, every
    if low_memory:  # the step is in backward: nothing to clip
        cfg.optim.grad_clip = 0.0
    setup = setup_from_config(cfg, device="cpu", args=args)
    assert setup.trainable == Trainability.from_model(model)  # the config says what trains
    return tracker.peak, setup


MATRIX = [dict(lora=lora, ckpt=ckpt, micro_batch=mb)
          for lora in (False, True) for ckpt in (False, True) for mb in (1, 4)]
EXTRA = [dict(lora=False, ckpt=False, micro_batch=4, bf16=True),
         dict(lora=True, ckpt=True, micro_batch=4, bf16=True),
         dict(lora=True, ckpt=False, micro_batch=4, quantize="nf4", dropout=0.1),
         # a vocabulary large enough for the logits to dominate, whole and chunked
         dict(lora=False, ckpt=True, micro_batch=4, vocab=8192),
         dict(lora=False, ckpt=True, micro_batch=4, vocab=8192, loss_chunk=32),
         dict(lora=True, ckpt=True, micro_batch=4, vocab=8192, loss_chunk=32, bf16=True),
         # the low-memory full fine-tune: bf16 weights and moments, step in backward
         dict(lora=False, ckpt=False, micro_batch=4, bf16=True, low_memory=True),
         dict(lora=False, ckpt=True, micro_batch=1, bf16=True, low_memory=True),
         dict(lora=False, ckpt=True, micro_batch=4, vocab=8192, bf16=True, low_memory=True),
         # fp16: bf16's bytes, except a LoRA run's frozen base, which stays fp32
         dict(lora=False, ckpt=False, micro_batch=4, fp16=True),
         dict(lora=True, ckpt=True, micro_batch=4, fp16=True)]
# GPT-J: one LayerNorm read by both branches (under bf16 autocast each of q/k/v and fc_in
# keeps its own bf16 copy of it), partial rotary, GELU MLP and head with biases; QLoRA on
# every projection, checkpointed, peaks at fc_in's adapter sum in the recompute
GPTJ = [dict(family="gptj", lora=lora, ckpt=ckpt, micro_batch=4)
        for lora in (False, True) for ckpt in (False, True)]
GPTJ += [dict(family="gptj", lora=False, ckpt=False, micro_batch=4, bf16=True),
         dict(family="gptj", lora=True, ckpt=True, micro_batch=4, quantize="int8",
              targets=("q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"))]

# Selective checkpointing (blocks 0, 2, ...): over 4 blocks the last one keeps every
# tensor, over 3 it is recomputed; fp16 LoRA keeps an fp32 frozen base, whose autocast
# copies only the blocks that are not checkpointed keep for backward
SELECTIVE = [dict(lora=False, ckpt="selective", micro_batch=4, layers=4),
             dict(lora=False, ckpt="selective", micro_batch=4, layers=3),
             dict(lora=True, ckpt="selective", micro_batch=4, layers=4, fp16=True)]
# Qwen3's q/k norms: fp32 (the norm keeps q and k themselves), bf16 autocast (an fp32
# copy of each; the fp32 weight makes the rotation's input fp32), LoRA (frozen norms)
QWEN3 = [dict(family="qwen3", lora=False, ckpt=False, micro_batch=4),
         dict(family="qwen3", lora=False, ckpt=False, micro_batch=4, bf16=True),
         dict(family="qwen3", lora=True, ckpt=True, micro_batch=4)]


# Qwen3-MoE: full fine-tuning and LoRA on the attention and the experts (all-linear),
# with and without checkpointing, fp32 and bf16 autocast; held to MOE_TOLERANCE
MOE = [dict(family="qwen3_moe", lora=lora, ckpt=ckpt, micro_batch=4, bf16=bf16,
            targets=("all-linear",))
       for lora in (False, True) for ckpt in (False, True) for bf16 in (False, True)]
# a dense layer 0 before two sparse ones (its MLP untouched by all-linear LoRA)
MOE += [dict(family="qwen3_moe, dense layer 0", layers=3, lora=lora, ckpt=ckpt,
             micro_batch=4, targets=("all-linear",))
        for lora, ckpt in ((False, True), (True, "selective"))]
# DeepSeek-V3 (2 layers: one dense, one MoE): full fine-tuning and LoRA on every
# projection that has one (all-linear: MLA's five and the routed experts), with and
# without checkpointing, fp32; and full fine-tuning under bf16 autocast
MOE += [dict(family="deepseek_v3", lora=lora, ckpt=ckpt, micro_batch=4,
             targets=("all-linear",)) for lora in (False, True) for ckpt in (False, True)]
MOE += [dict(family="deepseek_v3", lora=False, ckpt=False, micro_batch=4, bf16=True,
             targets=("all-linear",))]
MOE_TOLERANCE = 0.10


# The families added in their own folders: the estimate reads only their BlockSpec
NEW_FAMILIES = [dict(family=family, lora=lora, ckpt=ckpt, micro_batch=4, bf16=bf16,
                     targets=("qkv_proj", "gate_up_proj") if family == "phi3" else
                     ("q_proj", "v_proj"))
                for family in ("phi3", "gemma3")
                for lora, ckpt, bf16 in ((False, False, False), (False, False, True),
                                         (True, True, False))]


# DPO: two rows per pair, and the live reference: a LoRA run's adapters-off pass, or a
# full-weight run's frozen copy of the weights and its pass
DPO = [dict(lora=lora, ckpt=ckpt, micro_batch=2, dpo=True, bf16=bf16)
       for lora, ckpt, bf16 in ((False, False, False), (True, False, False),
                                (True, True, True), (False, True, False))]
# a vocabulary large enough for the logits (the policy's and the reference pass's) to
# dominate, whole and a chunk at a time
DPO += [dict(lora=True, ckpt=True, micro_batch=2, dpo=True, vocab=8192, loss_chunk=chunk)
        for chunk in (0, 32)]


@pytest.mark.parametrize("case", MATRIX + EXTRA + GPTJ + SELECTIVE + QWEN3 + NEW_FAMILIES + DPO
                         + MOE, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_estimate_within_15_percent_of_measured_peak(case):
    measured, setup = measure_step(**case)
    estimated = estimate_memory(setup).peak_bytes
    error = estimated / measured - 1
    tolerance = MOE_TOLERANCE if case in MOE else TOLERANCE
    assert abs(error) <= tolerance, (
        f"estimate {estimated / 2**20:.3f} MiB vs measured {measured / 2**20:.3f} MiB "
        f"({error:+.1%})")


def test_the_estimate_follows_the_measurement_across_micro_batches():
    """The slope in the micro-batch is the activation model alone; check it separately
    from the static terms (within the same 15%)."""
    m1, s1 = measure_step(lora=False, ckpt=False, micro_batch=1)
    m4, s4 = measure_step(lora=False, ckpt=False, micro_batch=4)
    e1, e4 = estimate_memory(s1).peak_bytes, estimate_memory(s4).peak_bytes
    assert abs((e4 - e1) / (m4 - m1) - 1) <= TOLERANCE


@pytest.mark.parametrize("case", QWEN3, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_q_k_norms_cost_what_the_estimate_says(case):
    """Qwen3 against the same model without its q/k norms: the difference in peak (the
    norms' weights, gradients, optimizer states and saved tensors) is estimated within
    the same 15%."""
    with_norms, setup = measure_step(**case)
    without, plain_setup = measure_step(**{**case, "family": "qwen3 without q/k norms"})
    estimated = estimate_memory(setup).peak_bytes - estimate_memory(plain_setup).peak_bytes
    measured = with_norms - without
    assert measured > 0
    assert abs(estimated / measured - 1) <= TOLERANCE, (estimated, measured)


def test_measured_setup_matches_a_config_built_one():
    """setup_from_config gives the Setup the measured runs describe by hand."""
    cfg = JobConfig()
    for key, value in (("dim", 64), ("n_layers", 2), ("n_heads", 4), ("n_kv_heads", 2),
                       ("vocab_size", 256), ("ffn_dim", 176), ("max_seq_len", 128)):
        setattr(cfg.model, key, value)
    cfg.model.preset = "debug"
    cfg.data.seq_len, cfg.data.micro_batch_size = SEQ, 4
    cfg.lora.enabled, cfg.lora.targets = True, ["q_proj", "v_proj"]
    cfg.train.activation_checkpointing = "full"
    from_cfg = setup_from_config(cfg, device="cpu")
    _, by_hand = measure_step(lora=True, ckpt=True, micro_batch=4)
    assert from_cfg.args == dataclasses.replace(by_hand.args)
    assert estimate_memory(from_cfg).peak_bytes == pytest.approx(
        estimate_memory(by_hand).peak_bytes, rel=1e-9)
