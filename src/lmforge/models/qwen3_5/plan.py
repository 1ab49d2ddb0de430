"""Qwen3.5's tensor-parallel plan: Llama's names for the full-attention layers (the gate
rides in q_proj's rows per head, so its column split keeps each head's pair) and the MLP.
A linear-attention layer's part is ``models.tp.linear_attention_plan``, which
``parallel/tensor.py`` puts in place of the attention's for those blocks."""
from lmforge.models.llama.plan import block_plan, model_plan

__all__ = ["block_plan", "model_plan"]
