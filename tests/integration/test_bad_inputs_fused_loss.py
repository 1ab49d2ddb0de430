"""train.fused_loss refused in one line where it cannot apply: a vocabulary-sharded head
(parallel.tp > 1; its loss is loss_parallel's) and a pipeline (its last stage's schedule
owns the loss), as train.loss_chunk_tokens is."""
from __future__ import annotations

import pytest

from helpers.bad_inputs import Bad, check_refused, params

REFUSAL = r"^train\.fused_loss: supported with data parallelism / FSDP only \(set it to false"
TABLE = [  # (lmforge train in one process refuses the layout's world size first)
    Bad("a fused loss estimated under tensor parallelism",
        ["estimate", "train.fused_loss=true", "parallel.tp=2"], REFUSAL),
    Bad("a fused loss estimated in a pipeline",
        ["estimate", "train.fused_loss=true", "parallel.pp=2", "parallel.dp_shard=1"],
        REFUSAL),
]


@pytest.mark.parametrize("row", params(TABLE))
def test_fused_loss_input_is_refused_in_one_line(row, bad_input_assets, tmp_path, capsys,
                                                 monkeypatch):
    monkeypatch.delenv("LMFORGE_DEBUG", raising=False)
    check_refused(row, bad_input_assets, tmp_path, capsys)
