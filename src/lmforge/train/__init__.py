"""A training run: ``loop`` (the run top to bottom: runtime, data, model, checkpoints, the
step loop, the finish), ``model_setup`` (model build + LoRA + parallelism, pipeline
schedules), ``step`` (forward/backward of one step and the loss normalisation), ``optim``
(AdamW, schedules) with ``low_memory`` (bf16 AdamW, the step fused into backward),
``metrics`` (throughput, memory, JSONL/TensorBoard/W&B loggers)."""
