"""The models: one folder per family (``llama/``: Llama, Mistral, Qwen2, Qwen3; ``gptj/``),
each a plain nn.Module that reads like the paper with its HF mapping, tensor-parallel plan
and presets, described to the rest of lmforge by ``registry``; ``presets`` (the run's
architecture), ``hf`` (Hugging Face model directories, any family), ``mapping`` (the rules
every state-dict mapping follows), ``common`` (KV cache, materialize), ``loss`` (token
cross-entropy sums), ``generate`` (KV-cache generation). Imports only config;
parallelism, LoRA and quantization are applied from outside.
"""
