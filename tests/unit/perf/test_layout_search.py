"""lmforge plan: the layouts it enumerates, the time model's terms on hand-checked cases,
and the predictions against published throughput (docs/plan.md)."""
import dataclasses

import pytest

from lmforge.config import load_config
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.perf.layout_search import budget_gib, meshes, plan
from lmforge.perf.timing import DEVICES, Device, Link, ring, step_time, tp_seconds

SMALL = ["model.preset=small", "model.vocab_size=32000", "data.seq_len=512",
         "train.device=cuda"]  # 8 layers, 8 heads, 4 kv heads
BIG = dataclasses.replace(DEVICES["h100"], memory_gib=1e6)  # everything fits


def _setup(overrides, world):
    return setup_from_config(load_config(None, overrides), device="cuda", world_size=world)


def test_meshes_of_4_gpus_for_8_heads_4_kv_heads_8_layers_are_the_ten_legal_ones():
    args = _setup(SMALL, 1).args
    got = {(m["parallel.dp_replicate"], m["parallel.dp_shard"], m["parallel.tp"],
            m["parallel.pp"]) for m in meshes(args, 4, 4)}
    assert got == {(1, 4, 1, 1), (2, 2, 1, 1), (4, 1, 1, 1), (1, 2, 1, 2), (2, 1, 1, 2),
                   (1, 1, 1, 4), (1, 2, 2, 1), (2, 1, 2, 1), (1, 1, 2, 2), (1, 1, 4, 1)}
    assert all(m["parallel.tp"] <= 2 for m in meshes(args, 4, 2))  # tp stays in a node


def test_every_candidate_obeys_the_layout_rules():
    cfg = load_config(None, [*SMALL, "data.global_batch_size=8"])
    result = plan(cfg, 4, 2, BIG)
    assert result.candidates and len(result.candidates) == result.tried
    for c in result.candidates:
        s, k = c.setup, c.keys
        assert s.layout.world_size == 4 and s.layout.tp <= 2
        assert s.args.n_heads % s.layout.tp == 0 and s.args.n_kv_heads % s.layout.tp == 0
        assert s.args.n_layers % (s.layout.pp * s.cfg.parallel.pp_virtual_stages) == 0
        assert (8 // (s.layout.dp_replicate * s.layout.dp_shard)) % s.micro_batch == 0
        assert s.micro_batch * s.batch.microbatches * s.layout.dp_replicate * s.layout.dp_shard == 8
        assert not k["train.loss_chunk_tokens"] or (s.layout.tp == 1 and s.layout.pp == 1)
        assert s.layout.pp > 1 or s.cfg.parallel.pp_schedule == "1f1b"
    schedules = {c.setup.cfg.parallel.pp_schedule for c in result.candidates if c.setup.layout.pp == 2}
    assert schedules == {"gpipe", "1f1b", "interleaved_1f1b"}


def test_candidates_over_the_memory_budget_are_dropped():
    cfg = load_config(None, [*SMALL, "data.global_batch_size=8"])
    tight = dataclasses.replace(BIG, memory_gib=2.0)
    kept = plan(cfg, 4, 2, tight).candidates
    assert kept and all(c.peak_gib <= budget_gib(tight) for c in kept)
    assert len(kept) < len(plan(cfg, 4, 2, BIG).candidates)


@pytest.mark.parametrize("virtual,schedule", [(1, "1f1b"), (2, "interleaved_1f1b")])
def test_pipeline_bubble_is_p_minus_1_over_m_v_of_the_compute(virtual, schedule):
    s = _setup([*SMALL, "parallel.pp=4", "data.micro_batch_size=1",
                "data.global_batch_size=8", f"parallel.pp_schedule={schedule}",
                f"parallel.pp_virtual_stages={virtual}", "parallel.dp_shard=1"], 4)
    t = step_time(s, DEVICES["h100"], 8)
    assert s.batch.microbatches == 8
    assert t.bubble == pytest.approx((t.compute + t.recompute) * 3 / (8 * virtual))


def test_ring_collectives_move_n_minus_1_over_n_of_the_buffer():
    link = Link(gb_per_s=1.0, latency_us=0.0)
    assert ring("all_gather", 4e9, 4, link) == pytest.approx(3.0)
    assert ring("all_reduce", 4e9, 4, link) == pytest.approx(6.0)
    assert ring("reduce_scatter", 4e9, 1, link) == 0.0


def test_tp_communication_is_four_collectives_per_block_each_way_on_b_s_d():
    s = _setup([*SMALL, "parallel.tp=2", "data.micro_batch_size=2",
                "parallel.dp_shard=1"], 2)
    dev = Device("H100 SXM5", 80, Link(100.0, 0.0), Link(1.0, 0.0), 0.5)
    act = 2 * 512 * 512 * 2  # b x s x dim x bf16 bytes
    collective = act / 2 / 100e9  # (tp-1)/tp of it over the intra-node link
    # 2 all-gathers + 2 reduce-scatters per block, forward and backward, 8 blocks
    assert tp_seconds(s, dev, 8) == pytest.approx(4 * collective * 2 * 8)
    assert tp_seconds(s, dev, 1) == pytest.approx(100 * 4 * collective * 2 * 8)


def test_checkpointing_adds_recomputation_not_model_flops():
    times = {ac: step_time(_setup([*SMALL, f"train.activation_checkpointing={ac}"], 1),
                           DEVICES["h100"], 8) for ac in ("none", "selective", "full")}
    assert times["none"].recompute == 0
    assert times["full"].recompute == pytest.approx(2 * times["selective"].recompute)
    assert len({t.model_flops for t in times.values()}) == 1


def test_selective_recomputes_the_blocks_the_trainer_checkpoints():
    # 3 blocks, every 2: blocks 0 and 2 recompute, 2/3 of full's recomputation (not 1/2)
    three = [*SMALL, "model.n_layers=3"]
    full, selective = (step_time(_setup([*three, f"train.activation_checkpointing={ac}",
                                          "train.activation_checkpointing_every=2"], 1),
                                 DEVICES["h100"], 8) for ac in ("full", "selective"))
    assert selective.recompute == pytest.approx(full.recompute * 2 / 3)


def test_more_gpus_never_predict_a_slower_step_at_a_fixed_global_batch():
    cfg = load_config(None, [*SMALL, "data.global_batch_size=16"])
    steps = [plan(cfg, n, 8, BIG).candidates[0].time.total for n in (1, 2, 4, 8)]
    assert steps == sorted(steps, reverse=True) and steps[-1] < steps[0] / 4


# Published bf16 throughput (tokens/s per GPU) and the layout that reached it; docs/plan.md
# gives the sources. ratio: predicted / published with the device's default efficiency.
PUBLISHED = [
    ("torchtitan llama3.1-8b 8xH100 FSDP eager", "llama3.1-8b", 128256, 8192, 8, 2, 16,
     "selective", "h100", 5762, 1.15),
    ("torchtitan llama3.1-8b 8xH100 FSDP compile", "llama3.1-8b", 128256, 8192, 8, 2, 16,
     "selective", "h100", 6667, 1.00),
    ("torchtitan llama3-8b 64xA100 FSDP", "llama3-8b", 128256, 8192, 64, 1, 64,
     "selective", "a100-80g", 2904, 0.89),
    ("torchtitan llama3-70b 64xA100 FSDP", "llama3-70b", 128256, 8192, 64, 1, 64, "full",
     "a100-80g", 331, 0.79),
    ("torchtitan llama2-13b 64xA100 FSDP", "llama2-13b", 32000, 4096, 64, 2, 128, "none",
     "a100-80g", 2162, 0.86),
]


@pytest.mark.parametrize("case", PUBLISHED, ids=[c[0] for c in PUBLISHED])
def test_predicted_throughput_stays_within_25_percent_of_published(case):
    _, preset, vocab, seq, gpus, mb, gbs, ac, device, published, ratio = case
    s = _setup([f"model.preset={preset}", f"model.vocab_size={vocab}", f"data.seq_len={seq}",
                f"data.micro_batch_size={mb}", f"data.global_batch_size={gbs}",
                f"train.activation_checkpointing={ac}", "train.device=cuda"], gpus)
    got = step_time(s, DEVICES[device], 8).tokens_per_s / published
    assert 0.75 <= got <= 1.25
    assert got == pytest.approx(ratio, abs=0.02)  # docs/plan.md quotes this ratio
