"""The job configuration's types: one dataclass per section, each key declared once with
its default, its help and what it may hold (``keys.key``), which ``validate()``
(``checks.py``) and ``lmforge train --help`` read. The facts derived from a config are
``config.derived``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from lmforge.config.checks import validate
from lmforge.config.errors import show
from lmforge.config.keys import (DEVICES, PREFERENCE_OBJECTIVES, RL_LOSS_TYPES,
                                 RL_OBJECTIVES, RL_SCALE_REWARDS, SAMPLING_TEMPERATURE,
                                 IntOrAuto, key)

CHAT_TEMPLATES = ("auto", "chatml", "plain", "llama2", "llama3")
QUANTIZE_FORMATS = ("nf4", "int8")  # lora.quantize: storage of a frozen (QLoRA) base
# model.rope_scaling's keys by rope_type, those the Llama family reads (rope_scaling_from
# in models/llama/hf.py); any other (a typo, DeepSeek's mscale) would be silently ignored.
ROPE_SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "truncate"),
}


def rope_scaling_problem(value: dict) -> Optional[tuple[str, str]]:
    """model.rope_scaling's key at fault and why (None: every key is read)."""
    named = [k for k in ("rope_type", "type") if k in value]  # (transformers reads either)
    kind = value.get("rope_type", value.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
        return (named or ["rope_type"])[0], f"{show(kind)} is not one of " \
            f"{', '.join(ROPE_SCALING_KEYS)}"
    known = (*(named or ["rope_type"]), *ROPE_SCALING_KEYS[kind])
    unknown = next((k for k in value if k not in known), None)
    if unknown is None:
        return None
    return unknown, f"unknown key for rope_type {kind} (known: {', '.join(known)})"


@dataclass
class ModelConfig:
    preset: Optional[str] = key("tiny", "a named size (each family's presets.py; an "
                                "unknown name's error lists them); any model.* field set "
                                "overrides it")
    init_from: Optional[str] = key(None, "a local Hugging Face model directory to start "
                                   "from (weights, config.json, tokenizer)")
    tokenizer: Optional[str] = key(None, "directory holding tokenizer.json (default: "
                                   "init_from's, else one trained on the corpus)")
    dim: Optional[int] = key(None, "hidden size", bound="> 0")
    n_layers: Optional[int] = key(None, "transformer blocks", bound="> 0")
    n_heads: Optional[int] = key(None, "attention (query) heads", bound="> 0")
    n_kv_heads: Optional[int] = key(None, "key/value heads (GQA); default n_heads",
                                    bound="> 0")
    vocab_size: Optional[int] = key(None, "vocabulary (default: the tokenizer's)",
                                    bound="> 0")
    ffn_dim: Optional[int] = key(None, "MLP hidden size", bound="> 0")
    max_seq_len: Optional[int] = key(None, "positions the model takes", bound="> 0")
    rope_theta: Optional[float] = key(None, "RoPE base", bound="> 0")
    norm_eps: Optional[float] = key(None, "the norms' epsilon", bound="> 0")
    tie_embeddings: Optional[bool] = key(None, "the output layer shares the embedding")
    family: Optional[str] = key(None, "a variant of the preset's family, by HF model_type: "
                                "for a Llama-shaped preset llama | mistral | qwen2 | qwen3; "
                                "gptj for a GPT-J one")
    head_dim: Optional[int] = key(None, "heads sized apart from dim (Qwen3, Gemma 3)",
                                  bound="> 0")
    sliding_window: Optional[int] = key(None, "keys a query sees (model.family=mistral)",
                                        bound="> 0")
    rotary_dim: Optional[int] = key(None, "features of each head that rotate (GPT-J)",
                                    bound="> 0")
    n_experts: Optional[int] = key(None, "a mixture of experts' routed experts per layer",
                                   bound="> 0")
    top_k: Optional[int] = key(None, "experts each token is routed to (MoE)", bound="> 0")
    moe_ffn_dim: Optional[int] = key(None, "an expert's width (Qwen3-MoE, Mixtral, "
                                     "DeepSeek-V3)", bound="> 0")
    # typed Any: a mapping, in transformers' form (YAML, or {...} on the command line)
    rope_scaling: Any = key(None, "extend the context: {rope_type: yarn | linear | llama3, "
                            "factor: F, original_max_position_embeddings: N, ...} as in "
                            "transformers' config.json (Llama-shaped families); "
                            "model.max_seq_len follows unless set",
                            mapping=rope_scaling_problem)
    attention: str = key("sdpa", "how packed documents and sliding windows are masked: "
                         "sdpa (a dense mask) | flex (FlexAttention block masks, compiled; "
                         "a GPU for training)", choices=("sdpa", "flex"))


@dataclass
class DataConfig:
    kind: str = key("stdlib", "stdlib: the Python standard library's sources (the CPU "
                    "demo); text: local files or directories (.jsonl/.json/.parquet by "
                    "data.json_key, other files whole); pretrain: .bin/.idx prefixes "
                    "(lmforge preprocess); sft: chat or prompt/response records; "
                    "preference: prompt, chosen and rejected records (docs/preference.md); "
                    "prompts: prompt records with the rewards' fields (GRPO, docs/rl.md)",
                    choices=("stdlib", "text", "pretrain", "sft", "preference", "prompts"))
    path: Optional[Any] = key(None, "a path or a list of paths (required but for stdlib)")
    eval_path: Optional[Any] = key(None, "held-out data (default: data.eval_fraction of "
                                   "data.path)")
    eval_fraction: float = key(0.05, "held out when no eval_path is given: this fraction "
                               "of a text corpus's files (or its last tokens), of a pretrain "
                               "prefix's documents, of an SFT file's samples", bound="in [0, 1)")
    seq_len: int = key(256, "tokens per training sequence", bound="> 0")
    max_prompt_len: Optional[int] = key(None, "preference: a longer prompt keeps its last "
                                        "this many tokens (then the sequence is cut to "
                                        "seq_len + 1)", bound="> 0")
    micro_batch_size: IntOrAuto = key(8, "sequences per rank per forward pass; auto: the "
                                      "largest that the memory estimate fits into the GPU "
                                      "less a 5% margin, data.global_batch_size kept by "
                                      "accumulation (docs/estimate.md)", bound="> 0, or auto")
    global_batch_size: Optional[int] = key(None, "sequences per optimizer step over all "
                                           "data-parallel ranks (a multiple of "
                                           "micro_batch_size x dp); default one micro-batch "
                                           "per rank")
    tokenizer_vocab_size: int = key(2048, "vocabulary of the tokenizer lmforge trains on "
                                    "the corpus when no model.tokenizer is given", bound="> 0")
    json_key: str = key("text", "the text field of .jsonl/.json/.parquet records")
    append_eod: bool = key(True, "end each document with the end-of-document token")
    template: str = key("auto", "chat template of SFT samples: auto (the tokenizer's own "
                        "Jinja template, else plain) or one of the named ones "
                        "(data/templates.py)", choices=CHAT_TEMPLATES,
                        free_form='a "{prompt}...{response}" format string')
    blend: Optional[list] = key(None, "pretrain: [weight, prefix, weight, prefix, ...] "
                                "mixed by weight, as Megatron's data_path")
    document_mask: bool = key(False, "no token attends across the documents of a packed "
                              "sequence")
    pack: bool = key(False, "SFT: pack several samples into each sequence (with "
                     "document masks)")
    pad_to_multiple_of: int = key(8, "SFT without packing: each batch is padded to its "
                                  "longest sample, rounded up to a multiple of this (64 "
                                  "suits GPU kernels best); 0 pads to seq_len", bound=">= 0")
    group_by_length: bool = key(False, "SFT without packing: batch samples of similar "
                                "length together (spans of 64 optimizer steps sorted by "
                                "length, the steps shuffled), so batches pad less")
    num_workers: int = key(0, "DataLoader worker processes", bound=">= 0")


@dataclass
class OptimConfig:
    # The defaults are the CPU demo's (no config file = the demo); a run with
    # model.init_from gets fine-tuning defaults for lr and warmup_steps where its config
    # leaves them unset (config/defaults.py).
    name: str = key("adamw", "adamw | adamw_bf16 (bf16 moments with stochastic rounding, "
                    "for train.param_dtype=bf16)", choices=("adamw", "adamw_bf16"))
    lr: float = key(2e-3, "peak learning rate", bound="> 0")
    min_lr_ratio: float = key(0.1, "the schedule's final LR as a share of the peak",
                              bound="in [0, 1]")
    weight_decay: float = key(0.1, "AdamW's decoupled weight decay", bound=">= 0")
    beta1: float = key(0.9, "AdamW's beta1", bound="in [0, 1)")
    beta2: float = key(0.95, "AdamW's beta2", bound="in [0, 1)")
    eps: float = key(1e-8, "AdamW's epsilon", bound="> 0")
    grad_clip: float = key(1.0, "clip the global gradient norm to this; 0 disables",
                           bound=">= 0")
    warmup_steps: int = key(20, "linear warmup steps", bound=">= 0")
    schedule: str = key("cosine", "the LR decay after warmup",
                        choices=("cosine", "linear", "constant"))
    fused: Optional[bool] = key(None, "fused AdamW (default: where the device supports it)")
    in_backward: bool = key(False, "step each parameter as soon as its gradient is ready "
                            "and free the gradient (low-memory full fine-tuning; no "
                            "clipping or accumulation, one process)")


@dataclass
class TrainConfig:
    max_steps: int = key(300, "optimizer steps of the run (the LR schedule's length)",
                         bound="> 0")
    seed: int = key(1234, "seed of the weights, the data order and dropout",
                    bound="in [0, 2^63)")
    output_dir: str = key("runs/demo", "the run directory (checkpoints, logs, hf/ export)")
    log_every: int = key(10, "steps between logged records", bound="> 0")
    eval_every: int = key(0, "steps between held-out evaluations; 0: only at the end",
                          bound=">= 0")
    eval_batches: int = key(8, "held-out batches per evaluation", bound="> 0")
    checkpoint_every: int = key(0, "steps between checkpoints; 0: only at the end",
                                bound=">= 0")
    save: bool = key(True, "false: no final checkpoint and no hf/ export (benchmarks, "
                     "smoke runs); checkpoint_every still applies")
    keep_last: int = key(2, "checkpoints kept (older ones are deleted)", bound=">= 0")
    stop_at_step: Optional[int] = key(None, "end this invocation after this step "
                                      "(checkpointed), keeping the schedule of max_steps: "
                                      "for time-limited jobs that resume with "
                                      "train.resume=auto", bound=">= 1")
    resume: Optional[str] = key(None, "auto (the newest complete checkpoint in "
                                "output_dir) | a checkpoint path")
    overwrite: bool = key(False, "delete an earlier run's outputs in output_dir "
                          "(checkpoints, hf/, adapter/, logs) and start over; without it a "
                          "fresh run there is refused")
    verify_checkpoint: bool = key(True, "check a checkpoint's recorded checksums before "
                                  "resuming from it (resume=auto falls back to the newest "
                                  "that verifies; docs/security.md gives the cost)")
    device: str = key("auto", "auto: the GPU when one is visible", choices=DEVICES)
    dtype: str = key("auto", "compute dtype; auto: bf16 autocast on a GPU with bf16 (fp16 "
                     "on V100/T4), fp32 on the CPU", choices=("auto", "fp32", "bf16", "fp16"))
    param_dtype: str = key("fp32", "fp32 master weights | bf16 weights (with "
                           "optim.name=adamw_bf16)", choices=("fp32", "bf16"))
    activation_checkpointing: str = key("none", "recompute blocks in backward: none | full "
                                        "| selective (every n-th block)",
                                        choices=("none", "full", "selective"))
    activation_checkpointing_every: int = key(2, "selective: checkpoint blocks 0, n, 2n, "
                                              "...", bound="> 0")
    activation_offload: bool = key(False, "what the blocks save for backward waits in "
                                   "pinned CPU memory until backward needs it (GPU only)")
    compile: bool = key(False, "torch.compile each block")
    deterministic: bool = key(False, "torch's deterministic algorithms")
    progress_bar: Optional[bool] = key(None, "default: on when stderr is a terminal")
    log_sample_ids: bool = key(False, "log rank 0's sample ids of each logged step")
    sample_prompt: Optional[str] = key("def ", "the end-of-run sample's prompt; null (the "
                                       "default with model.init_from): one taken from the "
                                       "held-out data")
    sample_tokens: int = key(48, "tokens of the end-of-run sample", bound=">= 0")
    threads: int = key(0, "CPU threads for torch; 0 leaves torch's default", bound=">= 0")
    async_checkpoint: bool = key(False, "write checkpoints in the background (training "
                                 "waits only for the copy to CPU)")
    on_nonfinite: str = key("stop", "a NaN/Inf loss or gradient norm: skip the step | stop",
                            choices=("skip", "stop"))
    expert_bias_update: float = key(0.0, "DeepSeek-V3's auxiliary-loss-free balancing: "
                                    "after each step every expert's routing bias moves "
                                    "this much towards the mean load (the paper: 0.001); "
                                    "0: off; routers with a correction bias only",
                                    bound=">= 0")
    loss_chunk_tokens: int = key(0, "apply the output layer and the loss this many tokens "
                                 "at a time, recomputing each chunk's logits in backward "
                                 "(0: all at once)", bound=">= 0")
    fused_loss: bool = key(False, "the output layer and the loss fused, over chunks of "
                           "train.loss_chunk_tokens tokens (0: 1024): each chunk's logits "
                           "made and dropped, the summed losses' gradients computed in "
                           "the forward pass, per-token ones (preference, grpo) "
                           "recomputed in backward; no (tokens x vocab) tensor is kept "
                           "(models/fused_loss.py)")
    objective: str = key("auto", "what a step minimises: next_token (pretraining, text, "
                         "SFT's completions) or a preference loss on chosen/rejected pairs; "
                         "auto: dpo for data.kind=preference, grpo for data.kind=prompts, "
                         "else next_token; grpo: completions sampled from the prompts, "
                         "scored by rl.rewards (rl.*, docs/rl.md)",
                         choices=("auto", "next_token", *PREFERENCE_OBJECTIVES,
                                  *RL_OBJECTIVES))
    beta: float = key(0.1, "dpo, ipo, simpo: the preference loss's beta (IPO's tau)",
                      bound="> 0")
    label_smoothing: float = key(0.0, "dpo, simpo: the share of pairs taken to be "
                                 "mislabelled (cDPO)", bound="in [0, 0.5)")
    simpo_gamma: float = key(0.5, "simpo: the target reward margin", bound=">= 0")
    orpo_lambda: float = key(0.1, "orpo: the weight of the odds-ratio term", bound=">= 0")
    reference: str = key("live", "dpo, ipo: the reference log-probabilities: live (LoRA: "
                         "the model with its adapters off; full weights: a frozen copy) | "
                         "precomputed (one pass before training, stored in the run's "
                         "reference/ with checksums)",
                         choices=("live", "precomputed"))
    skip_memory_check: bool = key(False, "run even when the memory estimate exceeds the "
                                  "device's memory (refused otherwise, before anything is "
                                  "allocated; perf/budget.py)")


@dataclass
class ParallelConfig:
    dp_replicate: int = key(1, "HSDP: replicas across (typically) nodes", bound=">= 1")
    dp_shard: int = key(-1, "FSDP2 shards; -1: whatever is left of the world size",
                        bound="-1 (the rest of the world size) or >= 1")
    tp: int = key(1, "tensor parallelism (within a node)", bound=">= 1")
    cp: int = key(1, "context parallelism: each sequence split over this many ranks (K/V "
                  "gathered per layer; FSDP2 shards over dp_shard x cp)", bound=">= 1")
    pp: int = key(1, "pipeline stages", bound=">= 1")
    ep: int = key(1, "expert parallelism (a mixture of experts): each MoE layer's routed "
                  "experts split over this many ranks, tokens sent to their experts' "
                  "ranks; taken out of dp_shard, which it must divide (each rank holds "
                  "n_experts / ep experts, FSDP-sharded over dp_shard / ep)",
                  bound=">= 1")
    pp_schedule: str = key("1f1b", "the pipeline schedule",
                           choices=("gpipe", "1f1b", "interleaved_1f1b"))
    pp_virtual_stages: int = key(1, "stages per pipeline rank (interleaved_1f1b: >= 2)",
                                 bound=">= 1")
    zero: int = key(3, "FSDP2: 3 frees gathered parameters after forward, 2 keeps them "
                    "until backward", choices=(2, 3))
    sequence_parallel: bool = key(True, "with tp: norms and residuals split along the "
                                  "sequence")
    microbatches: Optional[int] = key(None, "pipeline microbatches per step (default: the "
                                      "fewest that keep every stage busy)", bound=">= 1")
    timeout_s: int = key(600, "seconds a collective waits for the other ranks before it "
                         "fails (a rank died, a node hangs), so that the job ends and "
                         "torchrun or SLURM can restart it", bound="> 0")


@dataclass
class LoraConfig:
    """LoRA / QLoRA fine-tuning (peft/). Off unless ``enabled``."""
    enabled: bool = key(False, "train LoRA adapters on a frozen base")
    rank: int = key(8, "the adapters' rank", bound="> 0")
    alpha: float = key(16.0, "the adapters' scale is alpha / rank", bound="> 0")
    dropout: float = key(0.0, "dropout on the adapters' input", bound="in [0, 1)")
    # typed Any so that a plain string is accepted on the command line
    targets: Any = key(None, "projection names, aliases (all-linear) or groups "
                       "(peft/targets.py); default: the family's (peft's: q_proj, v_proj; "
                       "Phi-3's qkv_proj)")
    rslora: bool = key(False, "scale by alpha / sqrt(rank) instead of alpha / rank")
    quantize: Optional[str] = key(None, "store the frozen base as nf4 (QLoRA) | int8",
                                  choices=(None, *QUANTIZE_FORMATS))
    adapter_from: Optional[str] = key(None, "a PEFT adapter directory to start from")


@dataclass
class EvalConfig:
    """lm-evaluation-harness benchmarks at the end of training (``lmforge bench-eval``'s
    options; docs in README "Benchmark it")."""
    # typed Any so that a comma-separated string is accepted on the command line
    harness_tasks: Any = key(None, "lm-eval tasks scored after the last step (a list, or "
                             "names separated by commas); their data must be local")
    harness_include_path: Optional[str] = key(None, "a folder of task YAMLs (lm-eval's "
                                              "--include-path); code: a !function runs its "
                                              "Python file (docs/security.md)")
    harness_limit: Optional[float] = key(None, "samples per task (a fraction when < 1)",
                                         bound="> 0")
    harness_num_fewshot: Optional[int] = key(None, "few-shot examples (default: the "
                                             "task's)", bound=">= 0")
    harness_batch_size: int = key(8, "requests scored per forward pass", bound="> 0")


@dataclass
class MetricsConfig:
    """Where a run's metrics go besides metrics.jsonl (train/trackers.py; docs/metrics.md).
    The logging rank alone writes them."""
    # typed Any so that a comma-separated string is accepted on the command line
    tracker: Any = key("tensorboard", "tensorboard, mlflow, wandb: a list, or names "
                       "separated by commas (none: metrics.jsonl alone)")
    tracker_required: bool = key(False, "stop the run when a tracker fails (else one line "
                                 "says so and the run goes on with the others)")
    run_name: Optional[str] = key(None, "the tracked run's name (default: the output "
                                  "directory's name)")
    mlflow_tracking_uri: Optional[str] = key(None, "MLflow's server or store (else "
                                             "MLFLOW_TRACKING_URI, else sqlite:/// the run "
                                             "directory's parent/mlflow.db)")
    mlflow_experiment: str = key("lmforge", "the MLflow experiment")
    wandb_project: Optional[str] = key(None, "the W&B project (else LMFORGE_WANDB_PROJECT, "
                                       "else lmforge)")
    wandb_mode: Optional[str] = key(None, "W&B online | offline (default: WANDB_MODE, else "
                                    "online with WANDB_API_KEY set, offline without)",
                                    choices=(None, "online", "offline"))


@dataclass
class RLConfig:
    """GRPO (train.objective=grpo): TRL's GRPOConfig names, so a TRL recipe translates key
    for key (docs/rl.md; the loss: models/grpo.py, the rewards: train/rewards.py)."""
    # typed Any so that a comma-separated string is accepted on the command line
    rewards: Any = key(None, "the rewards, summed with rl.reward_weights: exact_answer, "
                       "format, length, or path/to/file.py:function (user code, run as "
                       "such: docs/security.md); a list, or names separated by commas")
    reward_weights: Any = key(None, "one weight per reward (default 1 each)")
    answer_field: str = key("answer", "exact_answer: the record field holding the answer")
    format_pattern: Optional[str] = key(None, "format: a regular expression the whole "
                                        "completion must match (re.fullmatch, DOTALL)")
    num_generations: int = key(8, "completions sampled per prompt (the group whose mean "
                               "reward is the baseline)", bound=">= 2")
    max_completion_length: int = key(128, "tokens sampled per completion at most (TRL: "
                                     "512; a prompt has data.seq_len minus this)",
                                     bound="> 0")
    temperature: float = key(1.0, "sampling temperature (the log-probabilities the loss "
                             "uses are of the same tempered distribution)",
                             bound=SAMPLING_TEMPERATURE)
    top_p: float = key(1.0, "nucleus sampling's probability mass", bound="in (0, 1]")
    beta: float = key(0.0, "weight of the KL to the reference model (0: no reference)",
                      bound=">= 0")
    epsilon: float = key(0.2, "clipping: the ratio is kept above 1 - epsilon",
                         bound="in [0, 1)")
    epsilon_high: Optional[float] = key(None, "clipping: the ratio is kept below 1 + "
                                        "epsilon_high (default rl.epsilon; DAPO: 0.28)",
                                        bound="> 0")
    num_iterations: int = key(1, "optimizer steps on each rollout (the ratio to the "
                              "rollout's policy corrects the later ones)", bound=">= 1")
    scale_rewards: str = key("group", "advantages divided by the reward std of the group, "
                             "of the batch, or none (Dr. GRPO)", choices=RL_SCALE_REWARDS)
    loss_type: str = key("dapo", "per-token losses averaged per completion (grpo), over "
                         "completions x max_completion_length (dr_grpo) or over tokens "
                         "(dapo)", choices=RL_LOSS_TYPES)
    mask_truncated_completions: bool = key(False, "a completion cut at "
                                           "max_completion_length counts for nothing")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self, world_size: int = 1, distributed: Optional[bool] = None) -> "JobConfig":
        validate(self, world_size, distributed)
        return self
