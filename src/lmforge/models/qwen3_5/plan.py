"""Qwen3.5's tensor-parallel plan: Llama's names for the full-attention layers and the
MLP. Tensor parallelism is refused for a model with linear-attention layers until their
heads are split (``models.presets.check_layout_fits``), so this plan is not applied yet."""
from lmforge.models.llama.plan import block_plan, model_plan

__all__ = ["block_plan", "model_plan"]
