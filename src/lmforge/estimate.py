"""Peak memory per device for a config, before anything runs (``lmforge estimate``).

The model (docs/estimate.md derives every term) follows what autograd keeps alive in our
Llama: which tensors each op saves for backward, given which inputs require gradients and
which weights train, in the dtypes the run uses. It is the Korthikanti et al. (2022)
activation analysis written out for this model (RMSNorm, SwiGLU, RoPE, GQA, SDPA/flash
attention) and evaluated at the points of a step where memory peaks: the end of the
forward, the loss, the first and last block of the backward, and the optimizer step.

The same formulas serve GPU and CPU; only the framework overhead (CUDA context, allocator
slack, NCCL buffers vs. the Python process) and one kernel layout detail differ by device.
``TensorMemoryTracker`` measures the same quantity on a real run (live tensor storage),
which is how the estimate is validated on CPU (tests/unit/metrics/test_estimate_*.py).
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.models.llama import LlamaArgs
from lmforge.train.metrics import LoraSpec, Trainability, lora_spec, projection_shapes

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Bytes per parameter of a quantized frozen weight (peft/quant.py): NF4 packs two 4-bit
# codes per byte plus one absmax per block of 64, itself int8 with an fp32 scale per 256
# blocks (double quantization); int8 is one byte plus one fp32 scale per output row.
NF4_BLOCK, NF4_SCALE_GROUP = 64, 256
# Scratch while one weight is dequantized (codes -> int64 indices -> fp32 values -> the
# compute dtype), per parameter of the largest quantized matrix; measured on peft/quant.py.
DEQUANT_SCRATCH_BYTES = {"nf4": 13.0, "int8": 8.0}
# Optimizer states per trainable parameter (count, stored in the parameter's dtype).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "lion": 1, "adamw_bf16": 2}
# adamw_bf16 (train/low_memory.py) keeps its moments in bf16; the others in fp32.
STATE_BYTES = {"adamw_bf16": 2}
# optim.in_backward steps one parameter at a time. Bytes per element of the parameter
# being stepped, beside its gradient: AdamWBF16 holds both moments, the weight and the
# rounding noise in fp32 (16) and a rounding copy (fp32 bits and the bf16 result, 6); a
# torch optimizer stepped per parameter, about two fp32 temporaries.
IN_BACKWARD_STEP_BYTES = {"adamw_bf16": 22.0}
IN_BACKWARD_STEP_BYTES_DEFAULT = 8.0
# Not tensors: what a device needs beyond the allocator's peak allocated bytes.
CUDA_CONTEXT_GIB = 0.6  # CUDA context, kernels, cuBLAS workspaces (0.3-1 GiB in practice)
CUDA_ALLOCATOR_SLACK = 0.10  # reserved - allocated (fragmentation of the caching allocator)
NCCL_BUFFERS_GIB = 0.5  # communicators and their buffers, with more than one device
CPU_PROCESS_GIB = 0.3  # Python, torch, lmforge (0.22 GiB measured after import) + data


# --------------------------------------------------------------------------- inputs

@dataclass
class Setup:
    """Everything the estimate depends on; ``setup_from_config`` fills it from a config."""
    args: LlamaArgs
    seq_len: int
    micro_batch: int
    device: str = "cuda"  # cuda | cpu
    compute: str = "bf16"  # bf16 (autocast, or FSDP2 bf16 params) | fp32
    checkpointing: str = "none"  # none | full
    trainable: Trainability = field(default_factory=Trainability.full)
    lora: Optional[LoraSpec] = None
    optimizer: str = "adamw"
    fused_optimizer: Optional[bool] = None  # None: fused on cuda, per-tensor on cpu
    tp: int = 1
    pp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    zero: int = 3
    sequence_parallel: bool = True
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    microbatches: int = 1  # micro-batches per optimizer step (accumulation / pipeline)
    attention: str = "sdpa"  # sdpa (flash/efficient kernels) | eager (HF-style, S x S saved)
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens: logits made per chunk, recomputed
    param_dtype: str = "fp32"  # train.param_dtype: bf16 stores every weight in bf16
    in_backward: bool = False  # optim.in_backward: each parameter stepped in backward
    notes: list = field(default_factory=list)  # assumptions worth printing

    def __post_init__(self):
        if self.lora is not None and self.trainable == Trainability.full():
            self.trainable = Trainability.lora(self.lora)  # LoRA trains only its adapters

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def fsdp(self) -> bool:
        """FSDP2 wraps the model whenever data parallelism is on (the trainer's rule); it
        shards over dp_shard and, with bf16, gathers the parameters as bf16 (no autocast)."""
        return self.dp_shard * self.dp_replicate > 1

    @property
    def autocast(self) -> bool:
        """Whether autocast makes bf16 copies of fp32 weights (bf16 weights need none)."""
        return self.compute == "bf16" and not self.fsdp and self.param_dtype == "fp32"


def setup_from_config(cfg, device: Optional[str] = None, world_size: Optional[int] = None,
                      attention: str = "sdpa", base_dtype: Optional[str] = None) -> Setup:
    """A validated JobConfig -> Setup. ``device`` overrides train.device; ``world_size``
    resolves parallel.dp_shard=-1 (default: 1 device per unset dimension); ``base_dtype``
    (fp32 | bf16) is the storage of a LoRA run's frozen, unquantized weights."""
    from lmforge.config import ConfigError
    from lmforge.models.presets import model_args

    p = cfg.parallel
    fixed = p.dp_replicate * p.tp * p.pp
    if p.dp_shard == -1:
        ws = world_size or fixed
        if ws % fixed:
            raise ConfigError(f"parallel.dp_shard: world size {ws} is not divisible by "
                              f"dp_replicate x tp x pp = {fixed}")
        dp_shard = ws // fixed
    else:
        dp_shard = p.dp_shard
    cfg.validate(world_size=fixed * dp_shard)
    notes = []
    if cfg.model.init_from:
        from lmforge.models.hf import args_from_hf_config, read_hf_config

        args = model_args(cfg, base=args_from_hf_config(read_hf_config(cfg.model.init_from)))
    else:
        args = model_args(cfg)
        if cfg.model.vocab_size is None:  # as the trainer: the tokenizer's size
            if cfg.model.tokenizer:
                from lmforge.data.tokenizer import load_tokenizer

                vocab = load_tokenizer(cfg.model.tokenizer).vocab_size
            else:
                vocab = cfg.data.tokenizer_vocab_size
                notes.append(f"vocab {vocab}: the tokenizer the run trains on its corpus "
                             f"(data.tokenizer_vocab_size); set model.vocab_size to change")
            args = dataclasses.replace(args, vocab_size=vocab)
    for name, heads in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
        if heads % p.tp:
            raise ConfigError(f"parallel.tp: {p.tp} does not divide model.{name} ({heads})")
    dev = device or cfg.train.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    compute = cfg.train.dtype
    if compute == "auto":
        compute = "bf16" if dev == "cuda" else "fp32"
    spec = lora_spec(cfg)
    if spec is not None and base_dtype:
        if base_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--base-dtype: {base_dtype!r} is not fp32 or bf16")
        spec = dataclasses.replace(spec, base_dtype=base_dtype)
    per_step = cfg.data.micro_batch_size * p.dp_replicate * dp_shard
    accumulation = (cfg.data.global_batch_size or per_step) // per_step
    return Setup(args=args, seq_len=cfg.data.seq_len, micro_batch=cfg.data.micro_batch_size,
                 device=dev, compute=compute, checkpointing=cfg.train.activation_checkpointing,
                 trainable=Trainability.from_config(cfg), lora=spec, optimizer=cfg.optim.name,
                 fused_optimizer=cfg.optim.fused, tp=p.tp, pp=p.pp, dp_shard=dp_shard,
                 dp_replicate=p.dp_replicate, zero=p.zero,
                 sequence_parallel=p.sequence_parallel, pp_schedule=p.pp_schedule,
                 pp_virtual_stages=p.pp_virtual_stages,
                 microbatches=p.microbatches or accumulation, attention=attention,
                 loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                 param_dtype=cfg.train.param_dtype, in_backward=cfg.optim.in_backward,
                 notes=notes)


# ------------------------------------------------------------------ parameter counts

def block_params(args: LlamaArgs) -> dict[str, int]:
    counts = {name: i * o for name, (i, o) in projection_shapes(args).items()}
    counts["norms"] = 2 * args.dim
    return counts


def stage_layers(setup: Setup, stage: int) -> int:
    """Blocks on pipeline stage ``stage`` (the first stages take the remainder)."""
    base, extra = divmod(setup.args.n_layers, setup.pp)
    return base + (1 if stage < extra else 0)


@dataclass
class Weights:
    """Bytes of parameter storage on one device, split the way the table shows them."""
    trainable_params: int = 0
    trainable_bytes: float = 0.0
    frozen_params: int = 0
    frozen_bytes: float = 0.0
    # Blocks' matmul weights that autocast copies to bf16: trainable ones are cached for
    # the whole forward, frozen fp32 ones copied at each use (elements).
    matmul_trainable_fp32: int = 0
    matmul_frozen_fp32: int = 0
    head_copy: float = 0.0  # bytes of the output layer's bf16 weight copy under autocast
    largest_trainable: int = 0
    largest_quantized: int = 0
    block_trainable: int = 0  # per block, for FSDP transients
    block_total: int = 0
    down_trainable: int = 0  # down_proj's trainable parameters (weight and/or adapter)
    down_copy: float = 0.0  # bytes of down_proj's autocast bf16 weight copy


def _frozen_dtype(setup: Setup) -> str:
    """Storage of frozen, unquantized projection weights, as the trainer keeps them: bf16
    for a LoRA run computing in bf16 without quantization (``frozen_linears_to_bf16``),
    else fp32; ``--base-dtype`` overrides."""
    if setup.param_dtype == "bf16":
        return "bf16"
    if setup.lora is not None and setup.lora.base_dtype:
        return str(setup.lora.base_dtype)
    if setup.lora is not None and not setup.lora.quantize and setup.compute == "bf16":
        return "bf16"
    return "fp32"


def _quantized_bytes(kind: str, n_in: int, n_out: int) -> float:
    if kind == "nf4":
        n = n_in * n_out
        blocks = math.ceil(n / NF4_BLOCK)
        return n / 2 + blocks + 4 * math.ceil(blocks / NF4_SCALE_GROUP) + 4
    if kind == "int8":
        return n_in * n_out + 4 * n_out
    raise ValueError(f"lora.quantize: {kind!r} is not one of nf4, int8")


def stage_weights(setup: Setup, stage: int) -> Weights:
    """Parameter storage of pipeline stage ``stage`` on one of its devices (after TP, and
    FSDP sharding when zero >= 2)."""
    a, tr, tp = setup.args, setup.trainable, setup.tp
    frozen_b = DTYPE_BYTES[_frozen_dtype(setup)]
    param_b = DTYPE_BYTES[setup.param_dtype]  # trained weights; embeddings and norms too
    quant = setup.lora.quantize if setup.lora is not None else None
    w = Weights()

    def add(n: float, trains: bool, matmul: bool, storage: Optional[float] = None):
        n = int(n)
        if trains:
            w.trainable_params += n
            w.trainable_bytes += param_b * n
            w.largest_trainable = max(w.largest_trainable, n)
            if matmul:
                w.matmul_trainable_fp32 += n
        else:
            w.frozen_params += n
            # only projections change storage: embeddings and norms keep param_dtype
            w.frozen_bytes += (frozen_b if matmul else param_b) * n if storage is None \
                else storage
            if matmul and storage is None and frozen_b == 4:
                w.matmul_frozen_fp32 += n

    shapes = projection_shapes(a)
    layers = stage_layers(setup, stage)
    for _ in range(layers):
        before = (w.trainable_params, w.trainable_params + w.frozen_params)
        for name, (n_in, n_out) in shapes.items():
            trains = tr.trains(name)
            if not trains and quant:
                add(n_in * n_out / tp, False, True, _quantized_bytes(quant, n_in, n_out) / tp)
                w.largest_quantized = max(w.largest_quantized, n_in * n_out // tp)
            else:
                add(n_in * n_out / tp, trains, True)
            rank = tr.rank(name)
            if rank:
                add(rank * (n_in + n_out / tp), True, True)
            if name == "down_proj":
                w.down_trainable = (trains * n_in * n_out + rank * (n_in + n_out)) // tp
                # bf16 copies autocast makes for down_proj, freed after its backward:
                # the weight's if it is fp32 (trained, or frozen fp32), and the adapter's
                base = n_in * n_out if trains or (not quant and frozen_b == 4) else 0
                copied = (base + rank * (n_in + n_out)) / tp
                w.down_copy = 2.0 * copied if setup.autocast else 0.0
        add(2 * a.dim, tr.norms, False)
        w.block_trainable = w.trainable_params - before[0]
        w.block_total = w.trainable_params + w.frozen_params - before[1]
    if stage == 0:
        add(a.vocab_size * a.dim / tp, tr.embedding, False)
    block_copies = (w.matmul_trainable_fp32, w.matmul_frozen_fp32)
    if stage == setup.pp - 1:
        add(a.dim, tr.norms, False)
        tied = a.tie_embeddings and setup.pp == 1
        if not tied:  # (tied: the embedding's storage, already counted)
            add(a.vocab_size * a.dim / tp, tr.head, True)
        if tr.head or frozen_b == 4 or tied:  # (a tied head is the fp32 embedding)
            w.head_copy = 2.0 * a.vocab_size * a.dim / tp
    w.matmul_trainable_fp32, w.matmul_frozen_fp32 = block_copies
    if not setup.autocast:
        # fp32 compute casts nothing; FSDP2 computes with parameters gathered as bf16
        w.matmul_trainable_fp32 = w.matmul_frozen_fp32 = 0
        w.head_copy = 0.0
    return w


# ----------------------------------------------------------------- activation model

@dataclass
class Term:
    """Bytes per token of one tensor kept for backward. ``split``: how tensor parallelism
    divides it: "heads" (always by tp), "seq" (by tp with sequence parallelism), "none"."""
    name: str
    bytes: float
    split: str = "heads"


class _Block:
    """Walks one block the way autograd sees it, collecting what gets saved.

    R: bytes of the residual stream (the embedding's output dtype); C: bytes of matmul
    outputs; ``cast``: autocast copies fp32 activations to bf16 at every matmul."""

    def __init__(self, setup: Setup):
        s = setup
        self.s, self.a, self.tr = s, s.args, s.trainable
        self.C = 2 if s.compute == "bf16" else 4
        self.autocast = s.autocast
        if s.compute != "bf16":
            self.R = 4
        elif s.fsdp or s.param_dtype == "bf16":
            self.R = 2
        else:  # the embedding's output dtype: its storage (autocast leaves lookups alone)
            self.R = 4 if self.tr.embedding else DTYPE_BYTES[_frozen_dtype(s)]
        self.cast = self.autocast and self.R == 4
        self.lora_bytes = 2 if ((s.fsdp and s.compute == "bf16")
                                or s.param_dtype == "bf16") else 4  # adapter dtype
        self.dropout = s.lora is not None and s.lora.dropout > 0
        self.terms: list[Term] = []

    def add(self, name: str, nbytes: float, split: str = "heads") -> None:
        if nbytes:
            self.terms.append(Term(name, nbytes, split))

    def norm(self, label: str, rg_in: bool) -> bool:
        d = self.a.dim
        if rg_in:  # x.float() (the input itself when fp32) and rsqrt, kept by pow and mul
            self.add(f"{label} input (fp32)", 4 * d, "seq")
            self.add(f"{label} rsqrt", 4, "seq")
        if self.tr.norms:  # weight * y keeps y for the weight's gradient
            self.add(f"{label} normalized", self.R * d, "seq")
        return rg_in or self.tr.norms

    def linear_inputs(self, label: str, n_in: int, rg_in: bool, consumers: list[str],
                      in_bytes: int, split: str = "none", counted: bool = False) -> None:
        """Copies of one activation kept by the matmuls that read it (``consumers``).
        A trained weight's matmul keeps its input (a private bf16 copy under autocast when
        the input is fp32); a LoRA adapter keeps ``dropout(x).to(adapter dtype)``, which
        autocast casts again (a private bf16 copy). ``counted``: the activation is already
        kept by another op, so sharing it costs nothing more."""
        trained = [n for n in consumers if self.tr.trains(n)]
        adapted = [n for n in consumers if self.tr.rank(n)]
        own, shared, masks = 0.0, False, 0
        if trained:
            if self.autocast and in_bytes == 4:
                own += 2 * len(trained)
            else:
                shared = True
        # the dropout mask: bool from the fused CUDA kernel, the input's dtype on CPU
        mask_b = 1 if self.s.device == "cuda" else in_bytes
        for _ in adapted:
            if self.dropout and rg_in:
                masks += mask_b
            if self.autocast:
                own += 2
            elif self.dropout or in_bytes != self.lora_bytes:
                own += self.lora_bytes
            else:
                shared = True
        self.add(f"{label} dropout masks", masks * n_in, split)
        self.add(f"{label} copies", own * n_in, split)
        if shared and not counted:
            self.add(label, in_bytes * n_in, split)

    def adapter(self, name: str, n_in: int) -> None:
        rank = self.tr.rank(name)
        if rank:
            self.add(f"{name} lora_a output", self.C * rank, "heads")

    def walk(self, rg_x: bool) -> tuple[list[Term], bool]:
        a, tr, C = self.a, self.tr, self.C
        d, hd = a.dim, a.head_dim
        dq, dkv, f = a.n_heads * hd, a.n_kv_heads * hd, a.ffn_dim
        self.terms = []

        n1 = self.norm("attention norm", rg_x)
        self.linear_inputs("q/k/v input", d, n1, ["q_proj", "k_proj", "v_proj"], self.R)
        for name in ("q_proj", "k_proj", "v_proj"):
            self.adapter(name, d)
        rg = {p: n1 or tr.trains(p) or tr.rank(p) > 0 for p in ("q_proj", "k_proj", "v_proj")}
        # Each attention computes fp32 cos/sin tables (batch, seq, head_dim): kept as they
        # are in fp32; in bf16 apply_rope keeps bf16 copies, two per call (q and k).
        if C == 4 and (rg["q_proj"] or rg["k_proj"]):
            self.add("rope cos/sin (fp32)", 2 * 4 * hd, "none")
        elif C != 4:
            n_rope = rg["q_proj"] + rg["k_proj"]
            self.add("rope cos/sin copies", n_rope * 2 * C * hd, "none")
        attn = any(rg.values())
        if attn:
            if self.s.attention == "eager":  # HF eager: k/v repeated, S x S kept twice
                self.add("q (roped)", C * dq)
                self.add("k, v repeated to all heads", 2 * C * dq)
                self.add("attention softmax (fp32)", 4 * a.n_heads * self.s.seq_len)
                self.add("attention probs", C * a.n_heads * self.s.seq_len)
            else:  # flash/efficient SDPA keeps q, k, v, the output and the log-sum-exp
                self.add("q, k (roped), v", C * (dq + 2 * dkv))
                self.add("attention output", C * dq)
                self.add("attention logsumexp (fp32)", 4 * a.n_heads)
        # The o_proj input: a view of the SDPA output, which the flash/efficient kernels
        # (CUDA and CPU) write as (batch, seq, heads, head_dim); a copy in eager.
        is_view = attn and self.s.attention != "eager"
        self.linear_inputs("o_proj input", dq, attn, ["o_proj"], C, "heads", counted=is_view)
        self.adapter("o_proj", dq)
        o = attn or tr.trains("o_proj") or tr.rank("o_proj") > 0
        rg_h = rg_x or o

        n2 = self.norm("ffn norm", rg_h)
        self.linear_inputs("gate/up input", d, n2, ["gate_proj", "up_proj"], self.R)
        for name in ("gate_proj", "up_proj"):
            self.adapter(name, d)
        g = n2 or tr.trains("gate_proj") or tr.rank("gate_proj") > 0
        u = n2 or tr.trains("up_proj") or tr.rank("up_proj") > 0
        if g:
            self.add("gate output (silu input)", C * f)
        if u:
            self.add("silu output", C * f)
        if g:
            self.add("up output", C * f)
        self.linear_inputs("down_proj input", f, g or u, ["down_proj"], C, "heads")
        self.adapter("down_proj", f)
        down = g or u or tr.trains("down_proj") or tr.rank("down_proj") > 0
        return list(self.terms), rg_h or down


def _per_device(terms: list[Term], setup: Setup) -> float:
    total = 0.0
    for t in terms:
        if t.split == "heads" or (t.split == "seq" and setup.sequence_parallel):
            total += t.bytes / setup.tp
        else:
            total += t.bytes
    return total


@dataclass
class Activations:
    """Per-token bytes (per device) of what one micro-batch keeps, layer by layer."""
    first_layer: float  # layer 0 (its input may not require grad)
    other_layers: float
    first_terms: list
    other_terms: list
    layer_input: float  # what checkpointing keeps per layer
    head_saved: float  # final norm + output-linear inputs
    logits: float  # (V) in the activation dtype, until the loss is computed
    log_softmax: float
    model_level: float  # the batch's ids and labels
    grad_transient: float  # gradient buffers at the MLP's elementwise backward
    mlp_freed: float  # down_proj's saved input, released just before that point
    input_is_saved: bool  # the block's first norm keeps the block input itself (fp32)


def activation_model(setup: Setup) -> Activations:
    a = setup.args
    blk = _Block(setup)
    first_terms, rg = blk.walk(setup.trainable.embedding)
    other_terms, _ = blk.walk(True) if a.n_layers > 1 else (first_terms, rg)
    if a.n_layers > 1:
        # every later block sees a residual stream that requires grad once anything trains
        rg = True
    head = _Block(setup)
    head.norm("final norm", rg)
    if setup.trainable.head:  # the output layer keeps its input (a bf16 copy in autocast)
        nbytes = (2 if head.cast else head.R) * a.dim
        head.add("output-layer input", nbytes, "none")
    split_v = setup.tp  # loss parallel: logits sharded over the vocabulary
    C = blk.C
    f_tp = a.ffn_dim / setup.tp
    d_seq = a.dim / (setup.tp if setup.sequence_parallel else 1)
    # The peak inside a block's backward: at silu(g) * u, with the incoming residual
    # gradient, d(m), d(silu(g)) and d(u) alive and down_proj's saved input just freed.
    grad_transient = blk.R * d_seq + 3 * C * f_tp
    mlp_freed = _per_device([t for t in other_terms if t.name.startswith("down_proj")],
                            setup)
    layer_input = blk.R * d_seq
    return Activations(first_layer=_per_device(first_terms, setup),
                       other_layers=_per_device(other_terms, setup),
                       first_terms=first_terms, other_terms=other_terms,
                       layer_input=layer_input, head_saved=_per_device(head.terms, setup),
                       logits=C * a.vocab_size / split_v,
                       log_softmax=4 * a.vocab_size / split_v,
                       model_level=16.0,  # the batch's input ids and labels (int64)
                       grad_transient=grad_transient, mlp_freed=mlp_freed,
                       input_is_saved=blk.R == 4)


def in_flight(setup: Setup, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once (Korthikanti et al.
    sec. 4.2: 1F1B keeps p - stage on stage ``stage``; interleaving adds (p-1)/(p v))."""
    p, m = setup.pp, max(setup.microbatches, 1)
    if p == 1:
        return 1.0
    if setup.pp_schedule == "gpipe":
        return float(m)
    held = min(p - stage, m)
    if setup.pp_schedule == "interleaved_1f1b" and setup.pp_virtual_stages > 1:
        held *= 1 + (p - 1) / (p * setup.pp_virtual_stages)
    return float(held)


# ------------------------------------------------------------------------- estimate

@dataclass
class MemoryEstimate:
    setup: Setup
    stage: int
    phase: str  # where the peak falls
    components: dict  # name -> bytes at the peak; they sum to peak_bytes
    phases: dict  # phase -> bytes
    overhead: dict  # name -> bytes, not tensors
    activations: Activations

    @property
    def peak_bytes(self) -> float:
        return sum(self.components.values())

    @property
    def overhead_bytes(self) -> float:
        return sum(self.overhead.values())

    @property
    def total_bytes(self) -> float:
        return self.peak_bytes + self.overhead_bytes

    def as_dict(self) -> dict:
        s = self.setup
        return {
            "model": describe_model(s.args),
            "setup": {"seq_len": s.seq_len, "micro_batch": s.micro_batch, "device": s.device,
                      "compute": s.compute, "checkpointing": s.checkpointing,
                      "optimizer": s.optimizer, "lora": dataclasses.asdict(s.lora)
                      if s.lora else None, "tp": s.tp, "pp": s.pp, "dp_shard": s.dp_shard,
                      "dp_replicate": s.dp_replicate, "zero": s.zero,
                      "sequence_parallel": s.sequence_parallel, "attention": s.attention,
                      "microbatches": s.microbatches},
            "notes": list(s.notes),
            "pipeline_stage": self.stage,
            "peak_phase": self.phase,
            "components_gib": {k: v / GiB for k, v in self.components.items()},
            "phases_gib": {k: v / GiB for k, v in self.phases.items()},
            "peak_allocated_gib": self.peak_bytes / GiB,
            "overhead_gib": {k: v / GiB for k, v in self.overhead.items()},
            "total_gib": self.total_bytes / GiB,
        }


def describe_model(args: LlamaArgs) -> str:
    return (f"dim {args.dim}, {args.n_layers} layers, {args.n_heads}/{args.n_kv_heads} "
            f"heads, ffn {args.ffn_dim}, vocab {args.vocab_size}")


def _optimizer_transient(setup: Setup, w: Weights, shard: int) -> float:
    fused = setup.fused_optimizer
    if fused is None:
        fused = setup.device == "cuda"
    if fused or setup.optimizer not in ("adamw", "adam"):
        return 0.0
    if setup.device == "cuda":  # foreach: a sqrt(v) temporary for every parameter at once
        return 4 * w.trainable_params / shard
    return 2 * 4 * w.largest_trainable  # per-tensor: sqrt(v) and its quotient


def estimate_stage(setup: Setup, stage: int) -> MemoryEstimate:
    s, tokens = setup, setup.micro_batch * setup.seq_len
    w = stage_weights(s, stage)
    act = activation_model(s)
    n_states = OPTIMIZER_STATES.get(s.optimizer)
    if n_states is None:
        raise ValueError(f"optim.name: no memory model for {s.optimizer!r} "
                         f"(known: {', '.join(OPTIMIZER_STATES)})")
    # FSDP2 (zero 2 and 3 alike) shards parameters, gradients and optimizer state over
    # dp_shard; zero 2 only keeps the gathered parameters from forward to backward.
    param_shard = grad_shard = state_shard = s.dp_shard
    weights_trainable = w.trainable_bytes / param_shard
    weights_frozen = w.frozen_bytes / param_shard
    grad_b = DTYPE_BYTES[s.param_dtype]  # a gradient has its parameter's dtype
    grads = grad_b * w.trainable_params / grad_shard
    states = STATE_BYTES.get(s.optimizer, 4) * n_states * w.trainable_params / state_shard

    layers, first = stage_layers(s, stage), stage == 0
    last = stage == s.pp - 1
    held = in_flight(s, stage)
    per_layer = act.other_layers
    layer0 = act.first_layer if first else per_layer
    if s.checkpointing == "full":
        resident = held * layers * act.layer_input
        resident_one = act.layer_input
        # one block recomputed in backward; its input is the one checkpointing kept
        recompute = per_layer - (act.layer_input if act.input_is_saved else 0.0)
    else:
        resident = held * (layer0 + (layers - 1) * per_layer)
        resident_one = layer0 + (held - 1) * layers * per_layer
        recompute = 0.0
    head = (act.head_saved if last else 0.0)
    logits = act.logits if last else 0.0
    lsm = act.log_softmax if last else 0.0
    model_level = act.model_level * held if first else 0.0
    if not first:  # a later stage receives its input activations
        model_level = held * act.layer_input

    # autocast's bf16 weight copies: trainable ones cached until the forward ends, frozen
    # fp32 ones made per use; either is kept by its matmul for backward, except inside
    # checkpointed blocks (recomputed there, one block at a time)
    ckpt = s.checkpointing == "full"
    cache = 2 * w.matmul_trainable_fp32
    frozen_copies = 0.0 if ckpt else 2 * w.matmul_frozen_fp32
    block_saved = 0.0 if ckpt else cache + frozen_copies
    copies_layer = (cache + 2 * w.matmul_frozen_fp32) / max(layers, 1)
    g_block = grad_b * w.block_trainable / grad_shard
    g_down = grad_b * w.down_trainable / grad_shard
    g_head = grads - layers * g_block
    if s.trainable.embedding and first and not (s.args.tie_embeddings and s.pp == 1):
        g_head -= grad_b * s.args.vocab_size * s.args.dim / s.tp / grad_shard  # comes last
    g_head = max(g_head, 0.0)
    fsdp = 0.0
    if s.fsdp:  # gathered parameters in the compute dtype (zero 3: this block and the
        # prefetched next; zero 2: every block, kept from forward to backward), and the
        # unsharded fp32 gradients of a block before their reduce-scatter
        param_b = 2 if s.compute == "bf16" else 4
        fsdp = (param_b * w.block_total * (2 if s.zero >= 3 else layers)
                + 2 * 4 * w.block_trainable)
    scratch = 0.0
    if s.lora is not None and s.lora.quantize:
        scratch = DEQUANT_SCRATCH_BYTES[s.lora.quantize] * w.largest_quantized
    T = tokens
    C = act.logits / max(s.args.vocab_size / s.tp, 1)  # bytes per logit
    # The logits die with the loss function (its backward keeps the log-softmax, not
    # them). Chunked loss: one chunk's logits at a time (recomputed in backward), and the
    # head's autocast weight copy made per chunk too.
    T_head = min(s.loss_chunk_tokens, T) if s.loss_chunk_tokens else T
    head_copy_held = 0.0 if s.loss_chunk_tokens else w.head_copy

    static = {"weights (trainable)": weights_trainable, "weights (frozen base)": weights_frozen,
              "optimizer states": states}
    phases = {
        "forward end": {
            "activations": T * (resident + head + model_level),
            "loss head (logits, log-softmax)": T_head * (logits + lsm
                                                          + (4 * s.args.vocab_size / s.tp
                                                             if C == 2 and last else 0)),
            "autocast weight copies": cache + frozen_copies + head_copy_held,
            "FSDP unsharded parameters": fsdp},
        "backward: loss": {
            "activations": T * (resident + head + model_level),
            "loss head (logits, log-softmax)": T_head * 3 * lsm,  # + its grad, logits' grad
            "autocast weight copies": block_saved + w.head_copy,
            "FSDP unsharded parameters": fsdp},
        "backward: last block": {
            "activations": T * (resident + recompute + model_level - act.mlp_freed),
            "autocast weight copies": (block_saved + (copies_layer if ckpt else 0.0)
                                       - w.down_copy),
            "gradients": g_head + g_down,
            "backward buffers": T * act.grad_transient,
            "dequantization scratch": scratch,
            "FSDP unsharded parameters": fsdp},
        "backward: first block": {
            "activations": T * (resident_one + recompute + model_level - act.mlp_freed),
            "autocast weight copies": max(copies_layer - w.down_copy, 0.0),
            "gradients": g_head + (layers - 1) * g_block + g_down,
            "backward buffers": T * act.grad_transient,
            "dequantization scratch": scratch,
            "FSDP unsharded parameters": fsdp},
        "optimizer step": {
            "gradients": grads,
            "optimizer temporaries": _optimizer_transient(s, w, state_shard)},
    }
    if s.in_backward:
        _step_in_backward(s, w, phases, grad_b)
    totals = {name: sum(static.values()) + sum(parts.values()) for name, parts in phases.items()}
    phase = max(totals, key=totals.get)
    components = {k: v for k, v in {**static, **phases[phase]}.items() if v}
    overhead = _overhead(s, sum(components.values()))
    return MemoryEstimate(setup=s, stage=stage, phase=phase, components=components,
                          phases=totals, overhead=overhead, activations=act)


def _step_in_backward(s: Setup, w: Weights, phases: dict, grad_b: int) -> None:
    """optim.in_backward: a gradient is consumed by its parameter's step as soon as it is
    complete and freed, so there is no separate optimizer step; backward holds one
    parameter's gradient and step temporaries at a time: a block's largest projection in
    the block phases, the output layer's right after the loss, the embedding's at the end
    (a tied embedding's gradient waits there from the output layer on)."""
    step = IN_BACKWARD_STEP_BYTES.get(s.optimizer, IN_BACKWARD_STEP_BYTES_DEFAULT)
    tr, a = s.trainable, s.args
    block = max((n_in * n_out / s.tp for name, (n_in, n_out) in projection_shapes(a).items()
                 if tr.trains(name)), default=0.0)
    table = a.vocab_size * a.dim / s.tp
    tied = a.tie_embeddings and s.pp == 1
    held = grad_b * table if tied and tr.embedding else 0.0
    del phases["optimizer step"]
    for name in ("backward: last block", "backward: first block"):
        phases[name]["gradients"] = held + grad_b * block
        phases[name]["optimizer temporaries"] = step * block
    if tr.head and not tied:
        phases["backward: output layer step"] = {
            "activations": phases["backward: loss"]["activations"],
            "gradients": grad_b * table, "optimizer temporaries": step * table}
    if tr.embedding:
        phases["backward: embedding step"] = {
            "gradients": grad_b * table, "optimizer temporaries": step * table}


def _overhead(setup: Setup, peak: float) -> dict:
    if setup.device == "cuda":
        out = {"CUDA context and workspaces": CUDA_CONTEXT_GIB * GiB,
               "caching-allocator slack (10%)": CUDA_ALLOCATOR_SLACK * peak}
        if setup.world_size > 1:
            out["NCCL buffers"] = NCCL_BUFFERS_GIB * GiB
        return out
    return {"Python process (interpreter, libraries)": CPU_PROCESS_GIB * GiB}


def estimate_memory(setup: Setup) -> MemoryEstimate:
    """The peak over pipeline stages (the first holds the most activations, the last the
    loss head); with pp=1 the one stage."""
    stages = {0, setup.pp - 1}
    return max((estimate_stage(setup, st) for st in sorted(stages)),
               key=lambda e: e.total_bytes)


def max_micro_batch(setup: Setup, device_memory_gib: float, limit: int = 1 << 16) -> int:
    """The largest micro-batch whose estimated total fits ``device_memory_gib``; 0 if even
    one sequence does not."""
    budget = device_memory_gib * GiB

    def fits(b: int) -> bool:
        return estimate_memory(dataclasses.replace(setup, micro_batch=b)).total_bytes <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------- output

def format_table(est: MemoryEstimate, device_memory_gib: Optional[float] = None,
                 fit: Optional[int] = None) -> str:
    s = est.setup
    lora = "full training"
    if s.lora is not None:
        lora = (f"LoRA r{s.lora.rank} on {','.join(s.lora.targets)}, base "
                f"{s.lora.quantize or _frozen_dtype(s)}")
    lines = [
        f"model: {describe_model(s.args)}",
        f"run: seq {s.seq_len} x micro-batch {s.micro_batch}, {s.compute} compute, {lora}, "
        f"{s.optimizer}, checkpointing {s.checkpointing}, attention {s.attention}",
        f"layout: {s.world_size} device(s) on {s.device}: dp_replicate {s.dp_replicate} x "
        f"dp_shard {s.dp_shard} x tp {s.tp} x pp {s.pp}, zero {s.zero}"
        + (f"; pipeline stage {est.stage}" if s.pp > 1 else ""),
        "",
        f"{'per device':46s}{'GiB':>10s}",
    ]
    for name, value in est.components.items():
        lines.append(f"  {name:44s}{value / GiB:10.3f}")
    lines.append(f"  {'peak allocated (' + est.phase + ')':44s}{est.peak_bytes / GiB:10.3f}")
    for name, value in est.overhead.items():
        lines.append(f"  {name:44s}{value / GiB:10.3f}")
    lines.append(f"  {'total':44s}{est.total_bytes / GiB:10.3f}")
    for note in s.notes:
        lines.append(f"note: {note}")
    if device_memory_gib is not None:
        verdict = "fits" if est.total_bytes <= device_memory_gib * GiB else "does NOT fit"
        lines.append("")
        lines.append(f"{verdict} in {device_memory_gib:g} GiB; largest micro-batch that fits: "
                     f"{fit}")
    return "\n".join(lines)


# ------------------------------------------------------------------------ measuring

class TensorMemoryTracker(TorchDispatchMode):
    """Live bytes of tensor storage, and their peak, while the mode is active.

    Every op's outputs are seen at the dispatcher (forward, backward, optimizer); a
    storage counts from the op that created it until Python frees it (a weakref
    finalizer on the storage). Views share their base's storage and count once. Tensors
    made before the mode count only once passed to ``track`` (parameters, optimizer
    state, the batch). Kernel-internal scratch (e.g. inside a fused attention kernel) is
    not a tensor and is not seen."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def track(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._register(t)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _register(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key, nbytes = id(storage), storage.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._sizes[key] = nbytes
            self.live += nbytes
            weakref.finalize(storage, self._free, key)
        elif old != nbytes:  # resized in place
            self._sizes[key] = nbytes
            self.live += nbytes - old
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            key = id(t.untyped_storage())
            if key not in inputs or key in self._sizes:
                self._register(t)
        return out


def _tensors(tree) -> list[torch.Tensor]:
    """The real (non-meta) tensors in nested tuples/lists/dicts."""
    if isinstance(tree, torch.Tensor):
        return [] if tree.device.type == "meta" else [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []
