"""The loader saves one state schema, whatever the dataset (here in-memory text)."""
import warnings

import numpy as np
import pytest

from lmforge.data.errors import DataError
from lmforge.data.loader import STATE_VERSION, BatchLoader, loader_state, resume_position
from lmforge.data.windows import TokenWindows


def _text_loader(dp_rank=0, dp_size=1, seed=3, n_tokens=401):
    windows = TokenWindows([np.arange(n_tokens, dtype=np.int32)], 10, seed, 2 * dp_size)
    return BatchLoader(windows, 2, dp_rank, dp_size, seed)


def test_text_loader_state_is_the_loader_state_schema():
    loader = _text_loader(dp_size=2)
    loader.next_batch()
    assert loader.state_dict() == loader_state(4, 3, 2, 2, [40])
    assert loader.state_dict()["version"] == STATE_VERSION
    assert loader.consumed_samples == 4


def test_text_loader_resumes_at_the_same_sample_on_another_dp_size():
    two = [_text_loader(r, 2) for r in range(2)]
    for _ in range(3):
        for loader in two:
            loader.next_batch()
    one = _text_loader()
    one.load_state_dict(two[0].state_dict())
    reference = _text_loader()
    for _ in range(6):
        reference.next_batch()
    assert one.next_batch()["sample_ids"].tolist() == reference.next_batch()["sample_ids"].tolist()


def test_resume_refuses_another_seed_and_warns_on_other_data(capsys):
    state = loader_state(8, 3, 2, 1, [40])
    with pytest.raises(DataError, match="train.seed=3"):
        resume_position(state, 4, [40])
    assert resume_position(state, 3, [41]) == 8
    assert capsys.readouterr().err.startswith("resume: the data differ")  # a plain line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resume_position(state, 3, [40]) == 8
    assert capsys.readouterr().err == ""
