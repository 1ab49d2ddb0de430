"""End to end, in process: a bit flipped in the newest checkpoint's shard is found at
``train.resume=auto``, the run falls back to the checkpoint before it, and its losses
from there equal those of the run that was never interrupted."""
from __future__ import annotations

import re

from helpers.runs import read_metrics
from helpers.tiny_models import tiny_model_overrides
from lmforge.config import load_config
from lmforge.train.loop import train


def _run(out, corpus, *extra):
    cfg = load_config(None, [
        *tiny_model_overrides(vocab_size=259), "data.kind=text", f"data.path={corpus}",
        "data.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=4",
        "data.tokenizer_vocab_size=259",
        "data.eval_fraction=0", "train.max_steps=4", "train.log_every=1",
        "train.checkpoint_every=2", "train.keep_last=0", "train.deterministic=true",
        "train.sample_tokens=0", "train.progress_bar=false", "train.device=cpu",
        "train.save=false", "optim.lr=1e-2", "optim.warmup_steps=0",
        f"train.output_dir={out}", *extra])
    train(cfg)
    return read_metrics(out)


def test_a_corrupt_newest_checkpoint_is_skipped_and_training_continues_exactly(tmp_path,
                                                                             capsys):
    corpus = tmp_path / "corpus.txt"
    words = "the quick brown fox jumps over a lazy dog while cats sleep".split()
    corpus.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(16))
                                for i in range(200)))
    straight = {r["step"]: r["loss"] for r in _run(tmp_path / "straight", corpus)}

    split = tmp_path / "split"
    _run(split, corpus, "train.stop_at_step=3", "train.save=true")  # saves steps 2 and 3
    shard = split / "checkpoints" / "step-0000003" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, inside the tensors
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    resumed = _run(split, corpus, "train.resume=auto")
    assert re.search(r"(?m)^train\.resume=auto: skipping .*step-0000003: checksum mismatch "
                     r"in __0_0\.distcp$", capsys.readouterr().err)  # one plain line
    # went on from step 2: the records of the first step 3 were replaced by the new ones
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed[2:]] == [straight[3], straight[4]]
