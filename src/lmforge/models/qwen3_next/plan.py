"""Qwen3-Next's and Qwen3.5-MoE's tensor-parallel plan: Qwen3.5's (Llama's names for the
full-attention layers and the dense layers' MLP; the linear-attention layers split by
heads, ``models.tp.linear_attention_plan``). The experts are computed whole on every rank
(``models.tp.ReplicatedMoE``, from ``parallel/tensor.py``); expert parallelism splits them."""
from lmforge.models.qwen3_5.plan import block_plan, model_plan

__all__ = ["block_plan", "model_plan"]
