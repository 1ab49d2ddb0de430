"""The memory model's terms and the `lmforge estimate` command (no model is allocated)."""
import dataclasses
import json

import pytest

from lmforge.cli import build_parser
from lmforge.config import ConfigError, JobConfig, load_config, set_field
from lmforge.models.llama import build_llama, count_parameters
from lmforge.models.presets import PRESETS
from lmforge.models.registry import build_model
from lmforge.perf.activations import activation_model, in_flight
from lmforge.perf.estimate import estimate_memory, estimate_stage, max_micro_batch
from lmforge.perf.estimate_setup import Setup, setup_from_config
from lmforge.parallel.pipeline import split_model
from lmforge.perf.weights import stage_layer_ids, stage_weights
from lmforge.peft.targets import LoraSpec

GiB = 2**30


# setup_for's keywords -> the config keys they set
KEYS = {"seq_len": "data.seq_len", "compute": "train.dtype",
        "checkpointing": "train.activation_checkpointing",
        "checkpoint_every": "train.activation_checkpointing_every", "tp": "parallel.tp",
        "pp": "parallel.pp", "dp_shard": "parallel.dp_shard", "zero": "parallel.zero",
        "sequence_parallel": "parallel.sequence_parallel",
        "pp_virtual_stages": "parallel.pp_virtual_stages"}


def setup_for(args, micro_batch: int = 1, microbatches: int = 1,
              lora: LoraSpec = None, attention: str = "sdpa", **changes) -> Setup:
    """The estimate of ``args`` trained on cuda as a config with ``changes`` would run it:
    ``microbatches`` is the accumulation (pp = 1) or the pipeline's microbatches."""
    cfg = JobConfig()
    for key, value in changes.items():
        set_field(cfg, KEYS[key], value)
    if cfg.parallel.dp_shard == -1:
        cfg.parallel.dp_shard = 1
    pp = cfg.parallel.pp
    if pp > 1:
        microbatches = max(microbatches, pp)
        cfg.data.micro_batch_size = micro_batch * microbatches
        cfg.parallel.microbatches = microbatches
        if cfg.parallel.pp_virtual_stages > 1:
            cfg.parallel.pp_schedule = "interleaved_1f1b"
    else:
        cfg.data.micro_batch_size = micro_batch
        cfg.data.global_batch_size = micro_batch * microbatches * cfg.parallel.dp_shard
    if lora is not None:
        cfg.lora.enabled, cfg.lora.rank = True, lora.rank
        cfg.lora.targets, cfg.lora.quantize = list(lora.targets), lora.quantize
    return setup_from_config(cfg, device="cuda", args=args, attention=attention,
                             base_dtype=lora and lora.base_dtype)


def setup_7b(**changes) -> Setup:
    return setup_for(PRESETS["llama2-7b"], **{"seq_len": 2048, "compute": "bf16", **changes})


def test_weights_count_every_parameter_of_the_model():
    # qwen3: q_norm and k_norm in every block; qwen2.5: biased q/k/v
    for name in ("tiny", "llama2-7b", "llama3-8b", "qwen2.5-0.5b", "qwen3-0.6b", "qwen3-8b"):
        args = PRESETS[name]
        w = stage_weights(setup_for(args, seq_len=128), 0)
        assert w.trainable_params == count_parameters(build_llama(args))
        assert w.trainable_bytes == 4 * w.trainable_params


def test_weights_count_every_gptj_parameter_layernorm_and_linear_biases_included():
    for name in ("gptj-tiny", "gptj-6b"):
        args = PRESETS[name]
        w = stage_weights(setup_for(args, seq_len=128), 0)
        assert w.trainable_params == count_parameters(build_model(args))  # (meta device)
    spec = LoraSpec(rank=8, targets=("q_proj", "v_proj"))
    lora = stage_weights(setup_for(PRESETS["gptj-6b"], seq_len=128,
                               lora=spec), 0)
    assert lora.trainable_params == 28 * 2 * 8 * (4096 + 4096)  # the biases stay frozen
    assert lora.frozen_params == 6_050_882_784


def test_gptj_biases_split_with_column_parallel_outputs_and_replicate_after_row_parallel():
    args, tp = PRESETS["gptj-6b"], 8
    one = stage_weights(setup_for(args, seq_len=128), 0).trainable_params
    split = stage_weights(setup_for(args, seq_len=128, tp=tp), 0)
    replicated = 28 * (2 * 4096 + 4096) + 2 * 4096  # ln_1, fc_out's bias; ln_f
    assert split.trainable_params == (one - replicated) / tp + replicated


def test_qwen3_q_k_norms_are_replicated_under_tensor_parallelism():
    args, tp = PRESETS["qwen3-8b"], 8
    one = stage_weights(setup_for(args, seq_len=128), 0).trainable_params
    split = stage_weights(setup_for(args, seq_len=128, tp=tp), 0)
    replicated = 36 * (2 * 4096 + 2 * 128) + 4096  # two norms, q/k norms; the final norm
    assert split.trainable_params == (one - replicated) / tp + replicated


def test_full_training_static_memory_is_16_bytes_per_parameter():
    est = estimate_memory(setup_7b())
    n = count_parameters(build_llama(PRESETS["llama2-7b"]))
    c = est.components
    assert c["weights (trainable)"] == 4 * n and c["optimizer states"] == 8 * n
    phases = estimate_stage(setup_7b(), 0)
    assert phases.phases["optimizer step"] == pytest.approx(16 * n)  # + grads, fused AdamW


def test_zero_sharding_and_tensor_parallel_divide_the_static_terms():
    one = estimate_memory(setup_7b())
    eight = estimate_memory(setup_7b(dp_shard=8))
    assert eight.components["optimizer states"] == pytest.approx(
        one.components["optimizer states"] / 8)
    assert eight.components["weights (trainable)"] == pytest.approx(
        one.components["weights (trainable)"] / 8)
    tp = estimate_memory(setup_7b(tp=2, dp_shard=4))
    # tp=2 halves the matrices (not the norms) of a dp_shard=4 layout
    assert tp.components["optimizer states"] == pytest.approx(
        eight.components["optimizer states"], rel=0.01)
    # sequence parallelism shards the norm/residual activations as well
    sp = activation_model(setup_7b(tp=4, sequence_parallel=True)).other_layers
    no_sp = activation_model(setup_7b(tp=4, sequence_parallel=False)).other_layers
    full = activation_model(setup_7b()).other_layers
    assert sp < no_sp < full


def test_checkpointing_keeps_one_layer_input_per_layer():
    none = estimate_stage(setup_7b(micro_batch=8), 0)
    full = estimate_stage(setup_7b(micro_batch=8, checkpointing="full"), 0)
    assert full.peak_bytes < none.peak_bytes
    act = full.activations
    # FSDP-free bf16 autocast: the residual stream is fp32 -> 4 bytes x dim per token
    assert act.layer_input == 4 * 4096


@pytest.mark.parametrize("preset", ["llama2-7b", "gptj-6b"])
@pytest.mark.parametrize("lora", [False, True])
def test_selective_checkpointing_lies_between_none_and_full_and_is_full_at_every_1(
        preset, lora):
    spec = LoraSpec(rank=8, targets=("q_proj", "v_proj")) if lora else None
    def base(**changes):
        return setup_for(PRESETS[preset], micro_batch=8, lora=spec, seq_len=2048,
                         compute="bf16", **changes)
    peak = {ac: estimate_memory(base(checkpointing=ac)).peak_bytes
            for ac in ("none", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["none"]
    every_1 = base(checkpointing="selective", checkpoint_every=1)
    full = base(checkpointing="full")
    assert estimate_stage(every_1, 0).phases == estimate_stage(full, 0).phases


def test_selective_checkpointing_counts_the_checkpointed_blocks_of_each_stage():
    """Blocks 0, every, 2 every, ... by the model's numbering: with every = 32 of 32
    layers over two stages, only the first stage's first block is checkpointed."""
    s = setup_7b(pp=2, microbatches=4, checkpointing="selective", checkpoint_every=32)
    none = setup_7b(pp=2, microbatches=4, checkpointing="none")
    assert estimate_stage(s, 1).phases == estimate_stage(none, 1).phases
    saved = estimate_stage(none, 0).phases["forward end"] - estimate_stage(s, 0).phases[
        "forward end"]
    act, tokens = activation_model(s), 2048 * in_flight(s, 0)
    assert saved == pytest.approx(tokens * (act.first_layer - act.layer_input))


@pytest.mark.parametrize("pp,virtual", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_stage_layer_ids_are_the_blocks_the_trainer_gives_each_rank(pp, virtual):
    args = dataclasses.replace(PRESETS["tiny"], n_layers=16)
    setup = setup_for(args, seq_len=16, pp=pp, pp_virtual_stages=virtual)
    model = build_llama(args)  # (meta device)
    for rank in range(pp):
        held = [int(i) for _, part in split_model(model, rank, pp, virtual)
                for i in part.layers.keys()]
        assert stage_layer_ids(setup, rank) == held


def test_activations_scale_with_micro_batch_and_sequence():
    a = estimate_stage(setup_7b(micro_batch=1, seq_len=1024), 0).phases["forward end"]
    b = estimate_stage(setup_7b(micro_batch=2, seq_len=1024), 0).phases["forward end"]
    c = estimate_stage(setup_7b(micro_batch=1, seq_len=2048), 0).phases["forward end"]
    assert b - a == pytest.approx(c - a)  # flash attention: linear in tokens


def test_eager_attention_adds_the_quadratic_term():
    sdpa = activation_model(setup_7b(seq_len=1024)).other_layers
    eager = activation_model(setup_7b(seq_len=1024, attention="eager")).other_layers
    heads = PRESETS["llama2-7b"].n_heads
    assert eager - sdpa > (4 + 2) * heads * 1024 * 0.9  # softmax fp32 + probs bf16


def test_lora_trains_only_its_adapters_and_a_quantized_base_is_smaller():
    spec = LoraSpec(rank=8, targets=("q_proj", "v_proj"), base_dtype="fp32")
    lora = setup_7b(lora=spec)
    w = stage_weights(lora, 0)
    assert w.trainable_params == 32 * 2 * 8 * (4096 + 4096)
    int8 = dataclasses.replace(spec, quantize="int8")
    nf4 = dataclasses.replace(spec, quantize="nf4")
    bf16 = dataclasses.replace(spec, base_dtype="bf16")
    sizes = {name: stage_weights(setup_7b(lora=s), 0).frozen_bytes / GiB
             for name, s in (("fp32", spec), ("bf16", bf16), ("int8", int8), ("nf4", nf4))}
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"] > sizes["nf4"]
    assert 3.3 < sizes["nf4"] < 4.5 and 6.0 < sizes["int8"] < 7.5  # + embedding/head fp32


def test_lora_base_storage_defaults_to_what_the_trainer_keeps():
    # bf16 compute stores frozen projections in bf16 (frozen_linears_to_bf16); fp32
    # compute, or a quantized base, leaves the rest of the frozen weights in fp32
    spec = LoraSpec(rank=8, targets=("q_proj", "v_proj"))
    auto_bf16 = stage_weights(setup_7b(lora=spec), 0)
    explicit = stage_weights(setup_7b(lora=dataclasses.replace(spec, base_dtype="bf16")), 0)
    fp32 = stage_weights(setup_7b(lora=spec, compute="fp32"), 0)
    assert auto_bf16.frozen_bytes == explicit.frozen_bytes
    embedding_and_head = 2 * 32000 * 4096
    assert auto_bf16.frozen_bytes > 2 * auto_bf16.frozen_params + embedding_and_head
    assert fp32.frozen_bytes == 4 * fp32.frozen_params


def test_largest_micro_batch_that_fits_is_the_last_one_under_the_budget():
    s = setup_7b(lora=LoraSpec(targets=("q_proj", "v_proj"), quantize="nf4"), seq_len=512)
    fit = max_micro_batch(s, 40)
    assert fit >= 1
    budget = 40 * GiB
    assert estimate_memory(dataclasses.replace(s, micro_batch_override=fit)).total_bytes <= budget
    assert estimate_memory(dataclasses.replace(s, micro_batch_override=fit + 1)).total_bytes > budget
    assert max_micro_batch(setup_7b(), 16) == 0  # full 7B training needs > 100 GiB


def test_pipeline_estimate_is_the_larger_of_the_first_and_last_stage():
    s = setup_7b(pp=4, microbatches=8)
    first, last = estimate_stage(s, 0), estimate_stage(s, 3)
    assert "loss head (logits, log-softmax)" not in first.components
    assert in_flight(s, 0) == 4 and in_flight(s, 3) == 1
    assert estimate_memory(s).total_bytes == max(first.total_bytes, last.total_bytes)


def cli(argv: list[str], capsys) -> tuple[int, str]:
    ns = build_parser().parse_args(["estimate", *argv])
    code = ns.func(ns)
    return code, capsys.readouterr().out


def test_cli_prints_a_table_or_json_with_the_largest_fitting_micro_batch(capsys):
    code, out = cli(["model.preset=llama2-7b", "model.vocab_size=32000", "data.seq_len=512",
                     "data.micro_batch_size=4", "lora.enabled=true", "lora.quantize=int8",
                     "--device", "cuda", "--device-memory-gib", "40"], capsys)
    assert code == 0
    assert "peak allocated" in out and "largest micro-batch that fits" in out
    code, out = cli(["model.preset=llama2-7b", "model.vocab_size=32000", "parallel.dp_shard=-1",
                     "--device", "cuda", "--json", "--device-memory-gib", "80",
                     "--world-size", "8"], capsys)
    data = json.loads(out)
    assert data["setup"]["dp_shard"] == 8 and data["fits"] in (True, False)
    assert data["total_gib"] > data["peak_allocated_gib"] > 0
    assert isinstance(data["max_micro_batch"], int)


def test_cli_estimates_gptj_6b_and_reports_its_parameters(capsys):
    code, out = cli(["model.preset=gptj-6b", "model.vocab_size=50400", "parallel.tp=8",
                     "train.activation_checkpointing=full", "train.dtype=bf16",
                     "--device", "cuda"], capsys)
    assert code == 0 and "gptj, 6,050,882,784 parameters" in out and "peak allocated" in out


def test_cli_estimates_a_70b_model_without_allocating_it(capsys):
    """70B on the meta device: nothing is allocated, the answer comes at once."""
    code, out = cli(["model.preset=llama3-70b", "parallel.dp_shard=-1", "parallel.tp=8",
                     "--device", "cuda", "--json", "--world-size", "64"], capsys)
    assert code == 0 and json.loads(out)["setup"]["tp"] == 8


def test_cli_bad_input_names_the_field(capsys):
    with pytest.raises(ConfigError, match="data.seq_len"):
        cli(["data.seq_len=0"], capsys)
    with pytest.raises(ValueError, match="--device-memory-gib"):
        cli(["--device-memory-gib", "-1"], capsys)
    with pytest.raises(ConfigError, match="parallel.tp"):
        setup_from_config(load_config(None, ["parallel.tp=3", "parallel.dp_shard=1"]),
                          world_size=3)


@pytest.mark.parametrize("preset", ["tiny", "qwen3-0.6b", "gemma3-1b"])
def test_the_estimates_kv_cache_is_what_the_decoder_allocates(preset):
    import torch
    from lmforge.models.common import new_caches
    from lmforge.perf.estimate import kv_cache_bytes_per_token

    args = dataclasses.replace(PRESETS[preset], n_layers=2)
    setup = setup_for(args)
    with torch.device("meta"):
        model = build_model(args)
    rows, length = 3, 40
    allocated = sum(c.k.nbytes + c.v.nbytes for c in new_caches(model, rows, length))
    assert kv_cache_bytes_per_token(setup) * rows * length == allocated
