"""One dataset protocol, one loader: every data.kind (and lmforge eval's files) is a
``Dataset`` batched by ``BatchLoader``, and the protocol takes a sample of two sequences
(a preference pair) and a dataset with state of its own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge import IGNORE_INDEX
from lmforge.config import load_config
from lmforge.data.build import build_data
from lmforge.data.dataset import Dataset, RowDataset, make_row
from lmforge.data.evalsets import eval_dataset
from lmforge.data.loader import BatchLoader
from lmforge.data.preprocess import preprocess

from .conftest import make_docs, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore:.*samples dropped:UserWarning")


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("kinds")
    docs = make_docs(60, seed=21)
    (root / "corpus.txt").write_text("\n\n".join(docs))
    write_jsonl(root / "docs.jsonl", [{"text": t} for t in docs])
    preprocess([root / "docs.jsonl"], root / "docs", tokenizer_dir, append_eod=True)
    preprocess([root / "docs.jsonl"], root / "more", tokenizer_dir, append_eod=True)
    words = make_docs(80, seed=22, min_words=1, max_words=4)
    write_jsonl(root / "sft.jsonl", [{"prompt": words[2 * i], "response": words[2 * i + 1]}
                                     for i in range(40)])
    return root


def _kinds(root):
    return {
        "text": ["data.kind=text", f"data.path={root / 'corpus.txt'}"],
        "pretrain": ["data.kind=pretrain", f"data.path={root / 'docs'}"],
        "blend": ["data.kind=pretrain", f"data.path={root / 'docs'}",
                  f"data.blend=[[0.7, {root / 'docs'}], [0.3, {root / 'more'}]]"],
        "sft": ["data.kind=sft", f"data.path={root / 'sft.jsonl'}", "data.template=plain"],
        "sft-packed": ["data.kind=sft", f"data.path={root / 'sft.jsonl'}",
                       "data.template=plain", "data.pack=true"],
    }


@pytest.mark.parametrize("kind", ["text", "pretrain", "blend", "sft", "sft-packed"])
def test_every_kind_trains_and_evaluates_through_the_one_loader(sources, tokenizer, kind):
    cfg = load_config(None, _kinds(sources)[kind] + [
        "data.seq_len=24", "data.micro_batch_size=2", "data.eval_fraction=0.2"])
    bundle = build_data(cfg, tokenizer, 0, 1, sources / "cache")
    assert type(bundle.train) is BatchLoader and isinstance(bundle.train.dataset, Dataset)
    dataset = bundle.train.dataset
    assert len(dataset) >= 1 and dataset.distinct_samples >= 1
    batch = bundle.train.next_batch()
    assert batch["sample_ids"].tolist() == [0, 1]
    assert torch.equal(batch["labels"], dataset.batch([0, 1])["labels"])
    assert bundle.eval_batches is not None, bundle.eval_note
    held = list(bundle.eval_batches())
    assert held and all((b["labels"] != IGNORE_INDEX).any() for b in held)
    assert bundle.train.consumed_samples == 2, "a held-out pass leaves training where it was"


def test_lmforge_eval_files_are_datasets_of_the_one_loader(sources, tokenizer):
    for path in (sources / "docs", sources / "docs.jsonl", sources / "corpus.txt",
                 sources / "sft.jsonl"):
        dataset = eval_dataset(path, tokenizer, 24)
        assert isinstance(dataset, Dataset), path
        batches = list(BatchLoader(dataset, 3).held_out_batches())
        ids = torch.cat([b["sample_ids"] for b in batches]).tolist()
        assert ids == list(range(len(dataset))), "every sample once, in order"


class Pairs(RowDataset):
    """A toy preference set: sample k is two sequences (chosen, rejected), collated by the
    dataset into two tensors of its own layout."""

    def __init__(self, n: int, seq_len: int):
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    @property
    def distinct_samples(self) -> int:
        return self.n

    def fingerprint(self) -> list:
        return [self.n]

    def __getitem__(self, k: int):
        k %= self.n
        chosen = np.arange(k, k + self.seq_len + 1)
        return make_row([chosen], self.seq_len), make_row([chosen[::-1]], self.seq_len)

    def batch(self, ks: list[int]) -> dict:
        pairs = [self[k] for k in ks]
        out = {}
        for which, side in (("chosen", 0), ("rejected", 1)):
            for key in ("input_ids", "labels"):
                out[f"{which}_{key}"] = torch.from_numpy(np.stack([p[side][key]
                                                                   for p in pairs]))
        out["sample_ids"] = torch.tensor(ks)
        return out


def test_a_sample_of_two_sequences_is_sharded_resumed_and_held_out_by_the_loader():
    ranks = [BatchLoader(Pairs(7, 5), 2, r, 2, seed=1) for r in (0, 1)]
    first = [loader.next_batch() for loader in ranks]
    assert [b["sample_ids"].tolist() for b in first] == [[0, 1], [2, 3]]
    assert first[1]["rejected_input_ids"][0].tolist() == [7, 6, 5, 4, 3]
    resumed = BatchLoader(Pairs(7, 5), 4, 0, 1, seed=1)
    resumed.load_state_dict(ranks[0].state_dict())
    assert resumed.next_batch()["sample_ids"].tolist() == [4, 5, 6, 7]
    held = [list(loader.held_out_batches()) for loader in ranks]
    assert [b["sample_ids"].tolist() for b in held[0]] == [[0, 1], [4, 5]]
    assert [b["sample_ids"].tolist() for b in held[1]] == [[2, 3], [6]]  # 7: a repeat
    assert not any(k.endswith("labels") and (v != IGNORE_INDEX).any()
                   for k, v in BatchLoader(Pairs(1, 5), 1, 1, 2).held_out_batches()
                   .__next__().items()), "a rank with nothing left scores no target"


class Counting(RowDataset):
    """A dataset with state of its own (as a curriculum would have)."""

    def __init__(self):
        self.level = 0

    def __len__(self) -> int:
        return 8

    distinct_samples = 8

    def fingerprint(self) -> list:
        return [8]

    def __getitem__(self, k: int) -> dict:
        return make_row([np.full(4, self.level + k % 8)], 3)

    def state_dict(self) -> dict:
        return {"level": self.level}

    def load_state_dict(self, state: dict) -> None:
        self.level = state["level"]


def test_a_datasets_own_state_travels_in_the_loader_state():
    loader = BatchLoader(Counting(), 2)
    loader.dataset.level = 5
    loader.next_batch()
    state = loader.state_dict()
    assert state["dataset"] == {"level": 5} and state["consumed_samples"] == 2
    resumed = BatchLoader(Counting(), 2)
    resumed.load_state_dict(state)
    assert resumed.dataset.level == 5
    assert torch.equal(resumed.next_batch()["input_ids"], loader.next_batch()["input_ids"])
