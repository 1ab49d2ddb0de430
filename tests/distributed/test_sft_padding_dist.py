"""SFT batches padded to their longest sample, on several layouts: data-parallel ranks
and micro-batches of different lengths (DDP, FSDP2), tensor + sequence parallel (lengths
a multiple of tp) and pipeline parallel (every batch seq_len wide) train like one process,
and count the positions they ran over (metrics ``tokens``) across ranks and resumes."""
import json
import random

import pytest

from helpers.runs import read_metrics, run_lmforge, tiny_overrides

pytestmark = pytest.mark.slow
STEPS, SEQ, GLOBAL_BATCH = 3, 64, 8


@pytest.fixture(scope="module")
def setup(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-padding")
    words = (tiny_corpus / "corpus.txt").read_text().split()
    rng = random.Random(3)
    records = [{"prompt": " ".join(rng.choices(words, k=rng.randint(1, 14))),
                "response": " ".join(rng.choices(words, k=rng.randint(1, 6)))}
               for _ in range(64)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    base = tiny_overrides(tiny_corpus, STEPS) + [
        "data.kind=sft", f"data.path={root / 'chat.jsonl'}", "data.template=plain",
        f"data.seq_len={SEQ}", "data.micro_batch_size=4"]
    run_lmforge(root / "single", base)
    return root, base, read_metrics(root / "single")


def _same_run(records, reference, same_tokens=True):
    """Per step: the same loss, gradient norm, valid tokens (and positions run over)."""
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, ref in zip(records, reference):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert got["valid_tokens"] == ref["valid_tokens"]
        assert got["tokens"] == ref["tokens"] or not same_tokens
    # shorter than seq_len: the lengths did differ between batches
    assert records[-1]["tokens"] < STEPS * SEQ * GLOBAL_BATCH or not same_tokens


def test_one_process_runs_over_fewer_positions_than_seq_len_padding(setup):
    _, _, reference = setup
    steps = [r["step"] for r in reference]
    assert all(r["tokens"] % 8 == 0 for r in reference)
    assert reference[-1]["tokens"] < steps[-1] * SEQ * GLOBAL_BATCH


@pytest.mark.parametrize("layout", [["parallel.dp_replicate=2", "parallel.dp_shard=1"],
                                    ["parallel.dp_shard=2"],
                                    ["parallel.tp=2", "parallel.sequence_parallel=true"]])
def test_data_and_tensor_parallel_train_like_one_process_on_the_same_lengths(setup, layout):
    """The rows of a rank's micro-batch are those of one of the single process's
    micro-batches, so the lengths, and the summed positions, are the same."""
    root, base, reference = setup
    out = root / "-".join(layout)
    run_lmforge(out, base + layout, nproc=2, torchrun=True)
    _same_run(read_metrics(out), reference)


def test_pipeline_parallel_pads_every_batch_to_seq_len_and_trains_like_one_process(setup):
    root, base, reference = setup
    proc = run_lmforge(root / "pp2", base + ["parallel.pp=2"], nproc=2, torchrun=True)
    assert "pipeline parallelism needs one shape" in proc.stdout
    records = read_metrics(root / "pp2")
    _same_run(records, reference, same_tokens=False)
    assert [r["tokens"] for r in records] == [r["step"] * SEQ * GLOBAL_BATCH for r in records]


def test_a_resumed_run_counts_the_positions_of_the_uninterrupted_one(setup):
    root, base, reference = setup
    run_lmforge(root / "resumed", base + ["train.stop_at_step=2"])
    run_lmforge(root / "resumed", base + ["train.resume=auto"])
    _same_run(read_metrics(root / "resumed"), reference)


@pytest.mark.long  # (16 s: make test-long; the resumed position count below stays)
def test_batches_grouped_by_length_train_alike_on_two_ranks_and_across_a_resume(setup):
    """data.group_by_length reorders the samples by (seed, epoch, global batch) alone:
    two ranks (no accumulation) and a resumed run train like one uninterrupted process
    (accumulating two micro-batches), over fewer positions than ungrouped batches."""
    root, base, ungrouped = setup
    grouped = base + ["data.group_by_length=true"]
    proc = run_lmforge(root / "grouped", grouped)
    assert "batched together (data.group_by_length)" in proc.stdout
    reference = read_metrics(root / "grouped")
    assert reference[-1]["tokens"] < ungrouped[-1]["tokens"]
    run_lmforge(root / "grouped-dp2", grouped + ["parallel.dp_shard=2"], nproc=2,
                torchrun=True)
    _same_run(read_metrics(root / "grouped-dp2"), reference)
    run_lmforge(root / "grouped-resumed", grouped + ["train.stop_at_step=2"])
    run_lmforge(root / "grouped-resumed", grouped + ["train.resume=auto"])
    _same_run(read_metrics(root / "grouped-resumed"), reference)
