"""Qwen3-MoE's and Mixtral's tensor-parallel plan: Llama's for the attention and the dense
layers' MLP (entries for modules an MoE layer lacks are skipped by ``parallel/tensor.py``).
The experts are not split by tensor parallelism (``models.presets.check_layout_fits``
refuses tp for an MoE model until they are)."""
from lmforge.models.llama.plan import block_plan, model_plan

__all__ = ["block_plan", "model_plan"]
