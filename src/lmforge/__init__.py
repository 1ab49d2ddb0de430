"""lmforge: pretrain, continue pretraining and fine-tune (full, LoRA, QLoRA) open LLMs with
PyTorch, from one CPU to a GPU cluster. The packages, bottom to top: config and fsio;
models and data; parallel; peft and checkpoint; perf and eval; export; train; cli (README,
"Layout")."""

# The label of a position with no target (torch's cross_entropy default): the data writes
# it, the loss and evaluation skip it. Defined here, below both models and data.
IGNORE_INDEX = -100
