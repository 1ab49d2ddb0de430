"""The estimate and the time model under context parallelism and dense attention masks
(perf/masks.py): per-rank tokens, the gathered k/v, the masks, FSDP over dp_shard x cp,
the cp collectives, and `lmforge plan` choosing cp for a long sequence. The estimate
against measured peaks of cp runs: tests/distributed/test_context_parallel.py."""
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.perf.activations import activation_model
from lmforge.perf.estimate import estimate_memory
from lmforge.perf.estimate_setup import setup_from_config
from lmforge.perf.layout_search import meshes, plan
from lmforge.perf.masks import dense_masks
from lmforge.perf.timing import DEVICES, Device, Link, cp_seconds, step_time

SMALL = ["model.preset=small", "model.vocab_size=32000", "data.seq_len=1024",
         "data.path=/nowhere/corpus"]  # 8 layers, dim 512, 8 heads, 4 kv heads of 64


def _setup(overrides, world, device="cuda"):
    return setup_from_config(load_config(None, [*SMALL, *overrides]), device=device,
                             world_size=world)


def _term(setup, name):
    return sum(t.bytes for t in activation_model(setup).other_terms if t.name.startswith(name))


def test_a_cp_rank_keeps_its_own_queries_and_the_gathered_keys_and_values():
    one = _setup(["parallel.dp_shard=1"], 1, "cpu")
    cp2 = _setup(["parallel.cp=2", "parallel.dp_shard=1"], 2, "cpu")
    assert cp2.tokens == one.tokens // 2
    kv = 2 * 4 * 4 * 64  # k and v, fp32, 4 kv heads of 64
    assert _term(one, "k (roped), v") == kv
    assert _term(cp2, "k (roped), v gathered over cp") == 2 * kv  # the sequence's keys
    assert _term(cp2, "q (roped)") == _term(one, "q (roped)")


def test_the_cpu_kernel_keeps_a_converted_mask_per_layer_and_cuda_repeats_kv_heads():
    cpu = _setup(["parallel.cp=2", "parallel.dp_shard=1", "data.micro_batch_size=2"], 2,
                 "cpu")
    masks = dense_masks(cpu)
    assert (masks.share, masks.windows, masks.keys, masks.per_row) == (1.0, 1, 1024, 0.5)
    # one (1, 1, 512, 1024) fp32 copy a layer over 2 x 512 local tokens
    assert _term(cpu, "attention mask") == 4 * 1024 / 2
    assert activation_model(cpu).masks == 1024 / 2  # the shared bool mask
    cuda = _setup(["parallel.cp=2", "parallel.dp_shard=1", "train.dtype=bf16"], 2)
    assert _term(cuda, "k (roped), v") == 2 * 2 * 8 * 64 * 2  # 8 heads: repeated
    assert _term(cuda, "attention mask") == 0


def test_documents_give_each_row_its_own_mask_and_plain_causal_layers_none():
    docs = _setup(["data.document_mask=true", "data.micro_batch_size=4"], 1, "cpu")
    assert dense_masks(docs).per_row == 1.0
    assert dense_masks(_setup([], 1, "cpu")).share == 0.0
    flex = _setup(["data.document_mask=true", "model.attention=flex"], 1)
    assert dense_masks(flex).share == 0.0  # block masks: not counted


def test_fsdp_shards_over_dp_shard_times_cp():
    flat = estimate_memory(_setup(["parallel.dp_shard=4"], 4)).components
    cp = estimate_memory(_setup(["parallel.dp_shard=2", "parallel.cp=2"], 4)).components
    for term in ("weights (trainable)", "optimizer states"):
        assert cp[term] == pytest.approx(flat[term])


def test_cp_communication_gathers_k_and_v_each_forward_and_reduces_their_gradients():
    s = _setup(["parallel.cp=2", "parallel.dp_shard=1", "train.dtype=bf16",
                "data.micro_batch_size=2"], 2)
    dev = Device("H100 SXM5", 80, Link(100.0, 0.0), Link(1.0, 0.0), 0.5)
    kv = 2 * 1024 * 4 * 64 * 2  # b x s x kv heads x hd, bf16
    one = kv / 2 / 100e9  # (cp-1)/cp of it
    # k and v: gathered forward, reduce-scattered backward; 8 blocks; no recomputation
    assert cp_seconds(s, dev, 8) == pytest.approx(2 * 2 * one * 8)
    full = _setup(["parallel.cp=2", "parallel.dp_shard=1", "train.dtype=bf16",
                   "data.micro_batch_size=2", "train.activation_checkpointing=full"], 2)
    assert cp_seconds(full, dev, 8) == pytest.approx(2 * 3 * one * 8)  # + recomputed
    t = step_time(s, dev, 8)
    assert t.cp_comm > 0 and t.tokens == 2 * 1024 / 2


def test_meshes_offer_cp_where_the_sequence_splits_into_2_cp_chunks():
    args = _setup([], 1).args
    got = {(m["parallel.cp"], m["parallel.tp"]) for m in meshes(args, 8, 8, 1024)
           if m["parallel.pp"] == 1 and m["parallel.dp_replicate"] == 1}
    assert {(2, 1), (4, 1), (8, 1), (2, 2), (2, 4), (4, 2)} <= got
    assert all(cp * tp <= 8 for cp, tp in got)
    assert {m["parallel.cp"] for m in meshes(args, 8, 8, 12)} == {1, 2}  # 12 = 2 x 2 x 3
    assert {m["parallel.cp"] for m in meshes(args, 8, 8)} == {1}


def test_plan_proposes_cp_for_llama_3_1_8b_at_131072_tokens_on_8_h100s():
    """The prediction docs/long-context.md quotes (a prediction: never run on GPUs)."""
    recipe = Path(__file__).resolve().parents[3] / "configs" / "llama3.1-8b-cpt-64k.yaml"
    cfg = load_config(str(recipe), [
        "model.init_from=null", "model.preset=llama3.1-8b", "model.vocab_size=128256",
        "data.seq_len=131072", "data.path=/nowhere/corpus"])
    best = plan(cfg, 8, 8, DEVICES["h100"]).candidates[0]
    assert best.setup.layout.cp > 1 and best.peak_gib <= 80 * 0.95
