"""The model: ``llama`` (a plain nn.Module that reads like the paper), ``presets`` (named
sizes), ``hf`` (Hugging Face config and state-dict mapping, loading and saving model
directories), ``meta`` (Meta's consolidated.*.pth import), ``loss`` (token cross-entropy
sums), ``generate`` (KV-cache generation). Imports only config; parallelism, LoRA and
quantization are applied from outside.
"""
