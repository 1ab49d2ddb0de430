"""Qwen3-Next's and Qwen3.5-MoE's tensor-parallel plan: Qwen3.5's (Llama's names for the
full-attention layers and the dense layers' MLP). Tensor parallelism is refused for a
model with linear-attention layers, and for the experts, until they are split
(``models.presets.check_layout_fits``), so it is not applied yet."""
from lmforge.models.qwen3_5.plan import block_plan, model_plan

__all__ = ["block_plan", "model_plan"]
