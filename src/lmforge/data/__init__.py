"""Text to training batches. ``tokenizer`` (the tokenizer's own special-token rules),
``templates`` (built-in and the model's Jinja chat templates, loss masks), ``readers`` and
``preprocess`` (raw JSONL/text/parquet to Megatron ``.bin/.idx``, via ``indexed``).

One data path: ``dataset`` (the ``Dataset`` protocol every ``data.kind`` implements, and the
row helpers), one dataset per kind (``windows``: stdlib and text corpora; ``pretrain``:
packed ``.bin/.idx`` windows and blends; ``sft``: chat samples; ``evalsets``: what
``lmforge eval`` reads), one ``loader.BatchLoader`` (deterministic, resumable,
data-parallel batches for training and held-out evaluation, dealt by ``sampler``),
``cache`` (every cache), ``build`` (what a run uses).
Imports only config: nothing here knows the model, the trainer or parallelism.
"""
