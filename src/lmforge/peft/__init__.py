"""Parameter-efficient fine-tuning: LoRA, QLoRA (NF4 / int8 frozen base), peft-format
adapters and merged exports. Modules, each building on the ones before it:
``targets`` (projection names and the rule reading ``lora.targets``), ``quant`` (quantized
frozen linears; knows nothing of LoRA; ``quant_experts`` the same for an MoE's stacked
expert weights), ``lora`` (the LoRA layer and the model-wide swap; ``expert_lora`` its
counterpart on an MoE block's stacked experts; ``summary`` the parameter counts),
``adapter_spec`` (what an adapter directory may say, checked whole before it is used;
``expert_adapters`` its experts' part, peft's ``target_parameters``), ``adapters``
(peft's on-disk layout, merged exports).

The trainer's calls, in order::

    prepare_model_for_lora(model, cfg.lora)   # after build (meta or loaded): swap + freeze
    after_materialize(model, cfg.lora)        # after to_empty + init/load: init A/B,
                                              # quantize the base
    load_adapter(model, cfg.lora.adapter_from)  # when set
    print(trainable_summary(model))           # "4.19M trainable / 6.74B total (0.06%)"
    ...train...
    save_adapter(model, out_dir, base_model_path, cfg.lora)   # peft layout
    export_merged(model, out_dir, tokenizer)                  # plain HF directory

and ``merge_lora(model)`` / ``unmerge_lora(model)`` for inference. Nothing here is
imported by the model code.
"""
from lmforge.peft.adapters import (AdapterError, adapter_state_dict, export_merged,
                                   load_adapter, merged_state_dict, read_adapter,
                                   save_adapter)
from lmforge.peft.lora import (LoraError, LoraLinear, adapters_disabled, after_materialize,
                               apply_lora,
                               count_trainable, freeze_base, init_lora_weights, lora_layers,
                               merge_lora, prepare_model_for_lora, trainable_summary,
                               unmerge_lora)
from lmforge.peft.quant import (QuantizationError, QuantizedLinear,
                                dequantize_base, is_quantized, quantize_base)
from lmforge.peft.targets import LoraSpec, lora_spec, resolve_targets

__all__ = [
    "AdapterError", "LoraError", "LoraLinear", "LoraSpec",
    "QuantizationError", "QuantizedLinear", "adapter_state_dict", "adapters_disabled",
    "after_materialize",
    "apply_lora", "count_trainable", "dequantize_base",
    "export_merged", "freeze_base", "init_lora_weights", "is_quantized", "load_adapter",
    "lora_layers", "lora_spec", "merge_lora", "merged_state_dict", "prepare_model_for_lora",
    "quantize_base", "read_adapter", "resolve_targets", "save_adapter", "trainable_summary",
    "unmerge_lora",
]
