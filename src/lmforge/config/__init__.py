"""Typed job configuration: one dataclass per section (``schema``), YAML and
``section.key=value`` overrides (``loading``), how a key is declared (``keys``),
``validate()`` (``checks``), the facts derived from a config (``derived``), and the
defaults that depend on the run (``defaults``). Everything is importable from
``lmforge.config``."""
from lmforge.config.defaults import apply_run_defaults, fine_tuning_defaults, warmup_warning
from lmforge.config.loading import (apply_dict, apply_override, config_yaml, load_config,
                                    read_yaml_file, save_config, set_field)
from lmforge.config.derived import (check_parallel_fits, compute_dtype,
                                    grad_accumulation_steps, objective_name,
                                    pipeline_microbatches,
                                    resolve_device, resolve_layout, samples_per_step)
from lmforge.config.errors import ConfigError, show
from lmforge.config.keys import (AUTO, DEVICES, OBJECTIVE_KEYS, PREFERENCE_OBJECTIVES,
                                 config_keys, describe_keys)
from lmforge.config.checks import TRACKERS, harness_task_names, tracker_names
from lmforge.config.schema import (CHAT_TEMPLATES, DataConfig, EvalConfig, JobConfig,
                                   LoraConfig, MetricsConfig,
                                   ModelConfig, OptimConfig, ParallelConfig,
                                   QUANTIZE_FORMATS, TrainConfig, validate)

__all__ = ["AUTO", "CHAT_TEMPLATES", "ConfigError", "DEVICES", "DataConfig", "EvalConfig",
           "JobConfig", "MetricsConfig", "TRACKERS", "tracker_names",
           "LoraConfig", "ModelConfig", "OBJECTIVE_KEYS", "OptimConfig",
           "PREFERENCE_OBJECTIVES",
           "ParallelConfig", "QUANTIZE_FORMATS", "TrainConfig", "apply_dict",
           "apply_override", "apply_run_defaults", "check_parallel_fits", "compute_dtype",
           "config_keys", "config_yaml", "describe_keys", "fine_tuning_defaults",
           "grad_accumulation_steps", "harness_task_names", "load_config", "objective_name",
           "pipeline_microbatches",
           "read_yaml_file", "resolve_device", "resolve_layout", "samples_per_step",
           "save_config", "set_field", "show", "validate", "warmup_warning"]
