"""Hugging Face's Qwen3.5-MoE language model (``qwen3_5_moe_text``, ``Qwen3_5MoeForCausalLM``)
<-> lmforge's ``HybridSparse``: Qwen3-Next's mapping (``models/qwen3_next/hf.py``, whose
``VARIANTS`` table has Qwen3.5-MoE's keys: the linear layers' projections stored apart,
every layer sparse, the top-k weights always renormalised, no dense width)."""
from lmforge.models.qwen3_next.hf import (args_from_hf_config, checkpoint_in, checkpoint_out,
                                          hf_config_from_args, hf_names)

__all__ = ["args_from_hf_config", "checkpoint_in", "checkpoint_out", "hf_config_from_args",
           "hf_names"]
