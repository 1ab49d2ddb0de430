"""The facts derived from a config (layout, accumulation, pipeline microbatches, compute
dtype) and their one definition each in lmforge.config (config/schema.py)."""
import pytest

from lmforge.config import (ConfigError, ParallelConfig, compute_dtype,
                            grad_accumulation_steps, load_config, pipeline_microbatches,
                            resolve_layout, samples_per_step)


def test_dp_shard_minus_one_takes_what_the_world_size_leaves():
    layout = resolve_layout(ParallelConfig(dp_replicate=2, tp=2), 16)
    assert layout == {"pp": 1, "dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 2}
    assert list(layout) == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]  # outermost first
    assert resolve_layout(ParallelConfig(dp_shard=3), 3)["dp_shard"] == 3
    assert resolve_layout(ParallelConfig(cp=4, tp=2), 16)["dp_shard"] == 2


def test_layout_whose_product_is_not_the_world_size_is_refused():
    with pytest.raises(ConfigError, match="^parallel.dp_shard"):
        resolve_layout(ParallelConfig(dp_shard=3), 4)
    with pytest.raises(ConfigError, match="^parallel.dp_shard"):
        resolve_layout(ParallelConfig(tp=3), 4)  # nothing left for dp_shard


def test_grad_accumulation_is_global_batch_over_one_micro_batch_per_rank():
    cfg = load_config(None, ["data.micro_batch_size=2", "data.global_batch_size=16"])
    assert samples_per_step(cfg, 4) == 16
    assert grad_accumulation_steps(cfg, 4) == 2
    assert grad_accumulation_steps(cfg, 1) == 8
    unset = load_config(None, ["data.micro_batch_size=2"])
    assert samples_per_step(unset, 4) == 8 and grad_accumulation_steps(unset, 4) == 1


def test_auto_dtype_computes_in_bf16_on_a_gpu_and_fp32_on_the_cpu():
    auto = load_config(None, [])
    assert compute_dtype(auto, "cuda") == "bf16" and compute_dtype(auto, "cpu") == "fp32"
    forced = load_config(None, ["train.dtype=bf16"])
    assert compute_dtype(forced, "cpu") == "bf16"
    assert compute_dtype(load_config(None, ["train.dtype=fp32"]), "cuda") == "fp32"


@pytest.mark.parametrize("overrides, field", [
    (["parallel.zero=1"], "parallel.zero"),
    (["parallel.pp_virtual_stages=0"], "parallel.pp_virtual_stages"),
    (["parallel.microbatches=0"], "parallel.microbatches"),
    (["parallel.tp=0"], "parallel.tp"),
    (["lora.rank=0"], "lora.rank"),
    (["lora.dropout=1.0"], "lora.dropout"),
    (["lora.quantize=fp4"], "lora.quantize"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    (["train.stop_at_step=0"], "train.stop_at_step"),
    (["data.eval_fraction=1"], "data.eval_fraction"),
    (["model.dim=-8"], "model.dim"),
    (["train.keep_last=-1"], "train.keep_last"),
])
def test_bounds_table_refuses_values_out_of_range_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=rf"^{field}: "):
        load_config(None, overrides).validate()


def test_integral_float_is_an_int_and_yaml_exponent_text_is_a_float():
    cfg = load_config(None, ["data.seq_len=128.0", "optim.lr=3e-4", "train.save=false"])
    assert cfg.data.seq_len == 128 and isinstance(cfg.data.seq_len, int)
    assert cfg.optim.lr == pytest.approx(3e-4) and cfg.train.save is False
    for bad, field in (("data.seq_len=1.5", "data.seq_len"), ("train.save=1", "train.save"),
                       ("optim.lr=fast", "optim.lr")):
        with pytest.raises(ConfigError, match=rf"^{field}: expected"):
            load_config(None, [bad])


@pytest.mark.parametrize("bf16_hardware, expected", [(True, "bf16"), (False, "fp16")])
def test_auto_dtype_is_fp16_on_a_gpu_without_bf16_arithmetic(monkeypatch, bf16_hardware,
                                                            expected):
    import torch
    from lmforge.config import JobConfig, compute_dtype
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: bf16_hardware)
    assert compute_dtype(JobConfig(), "cuda") == expected
    assert compute_dtype(JobConfig(), "cpu") == "fp32"


@pytest.mark.parametrize("overrides, world, expected", [
    # the demo's one micro-batch of 8 per step, split in two for 2 stages
    (["parallel.pp=2"], 2, 2),
    # accumulation steps that already fill the pipeline are the microbatches
    (["parallel.pp=2", "data.micro_batch_size=2", "data.global_batch_size=8"], 2, 4),
    # 3 accumulation steps of 2: 6 sequences, split into at least 4 pieces that divide them
    (["parallel.pp=4", "data.micro_batch_size=2", "data.global_batch_size=6"], 4, 6),
    # interleaved: a multiple of pp; 1f1b: at least pp
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
      "parallel.pp_virtual_stages=2", "data.micro_batch_size=2",
      "data.global_batch_size=6"], 2, 6),
    (["parallel.pp=2", "data.micro_batch_size=2", "data.global_batch_size=6"], 2, 3),
    # per data-parallel rank: 8 sequences over dp 2 is 4 each
    (["parallel.pp=2", "parallel.dp_shard=2", "data.micro_batch_size=4"], 4, 2),
    (["parallel.pp=2", "parallel.microbatches=8"], 2, 8),
])
def test_pipeline_microbatches_default_fills_the_pipeline_from_the_batch(overrides, world,
                                                                         expected):
    cfg = load_config(None, overrides).validate(world_size=world)
    dp = resolve_layout(cfg.parallel, world)["dp_shard"]
    assert pipeline_microbatches(cfg, dp) == expected


@pytest.mark.parametrize("overrides, message", [
    (["data.micro_batch_size=1"], r"^data.micro_batch_size: each rank runs 1 sequence"),
    (["parallel.microbatches=3"], r"^parallel.microbatches: 3 does not divide the 8"),
    (["parallel.microbatches=1"], r"^parallel.microbatches: 1 is fewer than the 2 pipeline"),
    (["parallel.microbatches=1", "parallel.pp_schedule=interleaved_1f1b",
      "parallel.pp_virtual_stages=2"], r"^parallel.microbatches: 1 is not a multiple of"),
])
def test_a_batch_the_pipeline_cannot_split_is_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["parallel.pp=2", *overrides]).validate(world_size=2)
