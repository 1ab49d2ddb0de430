"""Text to training batches. ``tokenizer`` (the tokenizer's own special-token rules),
``templates`` (built-in and the model's Jinja chat templates, loss masks), ``readers`` and
``preprocess`` (raw JSONL/text/parquet to Megatron ``.bin/.idx``, via ``indexed``),
``pretrain`` (packed windows) and ``sft`` (prompt/response samples), ``sampler`` and
``loader`` (deterministic, resumable, data-parallel batches), ``text`` (plain-text corpora),
``build`` (what a run uses).
Imports only config: nothing here knows the model, the trainer or parallelism.
"""
