"""The MMIDIDX writer and reader, and interchange with Megatron-LM's own classes."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from lmforge.data import indexed_files
from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from lmforge.data.indexed_files import bin_path, idx_path


def _random_docs(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(1, 50)) for _ in range(n)]


def test_token_dtype_follows_vocab_size():
    assert token_dtype(32000) == np.uint16
    assert token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32
    assert token_dtype(128256) == np.int32


def test_written_documents_read_back_zero_copy_in_megatron_layout(tmp_path):
    docs = _random_docs(100, 1000)
    prefix = tmp_path / "d"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    ds = IndexedDataset(prefix)
    assert len(ds) == ds.num_documents == 100
    assert ds.dtype == np.uint16
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        np.testing.assert_array_equal(ds.document(i), d)
    np.testing.assert_array_equal(ds.get(3, 1, 2), docs[3][1:3])
    # zero-copy: views into the memory map of .bin
    assert not ds[5].flags.owndata and isinstance(ds.tokens, np.memmap)
    # the raw header, byte for byte
    raw = open(idx_path(prefix), "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 100, 101)
    assert len(raw) == 34 + 100 * 12 + 101 * 8
    assert not list(tmp_path.glob("*.tmp-*"))


def test_multi_sequence_documents_read_back_across_side_file_spills(tmp_path, monkeypatch):
    monkeypatch.setattr(IndexedDatasetWriter, "_SPILL_ITEMS", 7)  # force side-file spills
    rng = np.random.default_rng(1)
    prefix = tmp_path / "m"
    expected = []
    with IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_documents(np.arange(10), np.array([3, 7]))
        expected += [np.arange(3), np.arange(3, 10)]
        for _ in range(20):
            parts = [rng.integers(0, 99999, size=rng.integers(1, 5)) for _ in range(3)]
            w.add_document(np.concatenate(parts), [len(p) for p in parts])
            expected.append(np.concatenate(parts))
    ds = IndexedDataset(prefix)
    assert ds.num_documents == 22 and len(ds) == 2 + 60
    for d, doc in enumerate(expected):
        np.testing.assert_array_equal(ds.document(d), doc)


def test_aborted_writer_leaves_no_files(tmp_path):
    prefix = tmp_path / "x"
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_missing_bad_header_or_truncated_files_are_refused_by_name(tmp_path):
    with pytest.raises(DataError, match="not found"):
        IndexedDataset(tmp_path / "missing")
    prefix = tmp_path / "bad"
    with IndexedDatasetWriter(prefix) as w:
        w.add_document([1, 2, 3, 4])
    data = bytearray(open(idx_path(prefix), "rb").read())
    open(idx_path(prefix), "wb").write(b"NOTANIDX!" + data[9:])
    with pytest.raises(DataError, match="bad header"):
        IndexedDataset(prefix)
    open(idx_path(prefix), "wb").write(bytes(data))
    open(bin_path(prefix), "wb").write(b"\x00\x00")
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(prefix)


def test_megatron_reads_our_files_as_written(tmp_path, megatron):
    docs = _random_docs(50, 30000, seed=2)
    prefix = str(tmp_path / "ours")
    with IndexedDatasetWriter(prefix, token_dtype(30000)) as w:
        for d in docs:
            w.add_document(d)
    theirs = megatron.IndexedDataset(prefix)
    assert len(theirs) == 50
    np.testing.assert_array_equal(theirs.document_indices, np.arange(51))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
        assert theirs[i].dtype == np.uint16


def test_we_read_files_megatron_wrote(tmp_path, megatron):
    import torch

    docs = _random_docs(40, 100000, seed=3)
    prefix = str(tmp_path / "theirs")
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in docs[:20]:
        builder.add_item(torch.tensor(d))
        builder.end_document()
    for d in docs[20:]:  # two sequences per document, as with sentence splitting
        cut = len(d) // 2
        builder.add_document(d, [cut, len(d) - cut])
    builder.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.int32 and ours.num_documents == 40 and len(ours) == 60
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ours.document(i), d)


def _ten_documents(tmp_path):
    prefix = tmp_path / "x_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in range(10):
            w.add_document(np.full(d + 1, d))
    return prefix


def _patch_idx(prefix, offset, fmt, value):
    data = bytearray(open(idx_path(prefix), "rb").read())
    struct.pack_into(fmt, data, offset, value)
    open(idx_path(prefix), "wb").write(bytes(data))


_LENGTHS, _S = 34, 10  # byte offset of the length array; sequences in _ten_documents
_POINTERS, _DOCS = _LENGTHS + 4 * _S, _LENGTHS + 12 * _S


@pytest.mark.parametrize("offset, fmt, value, message", [
    (_LENGTHS + 4 * 3, "<i", 2_000_000_000,
     r"x_text_document.idx: sequence 3 has 2000000000 tokens but its pointer and the next"),
    (_LENGTHS + 4 * 9, "<i", 2_000_000_000,
     r"sequence 9 has 2000000000 tokens .*\.bin holds only 55 tokens"),
    (_LENGTHS + 4 * 5, "<i", -1, r"sequence 5 has -1 tokens but its pointer and the next"),
    (_POINTERS + 8 * 7, "<q", 4, r"sequence 6 has 7 tokens but its pointer and the next"),
    (_POINTERS, "<q", 2, r"sequence 0 starts at byte 2"),
    (_DOCS + 8 * 4, "<q", 1, r"document 4 starts at sequence 1, before document 3"),
    (_DOCS + 8 * 10, "<q", 9, r"document index must run from 0 to the sequence count 10"),
])
def test_an_index_whose_lengths_pointers_or_documents_disagree_is_refused_naming_the_place(
        tmp_path, monkeypatch, offset, fmt, value, message):
    monkeypatch.setattr(indexed_files, "_CHECK_BLOCK", 3)  # the checks cross block boundaries
    prefix = _ten_documents(tmp_path)
    IndexedDataset(prefix)  # consistent as written
    _patch_idx(prefix, offset, fmt, value)
    with pytest.raises(DataError, match=message):
        IndexedDataset(prefix)


def test_an_index_whose_header_counts_disagree_with_its_size_or_the_bin_is_refused(tmp_path):
    prefix = _ten_documents(tmp_path)
    with open(idx_path(prefix), "ab") as f:
        f.write(b"\x00" * 24)  # three int64 more than the header's counts say
    with pytest.raises(DataError, match=r"x_text_document.idx: .* bytes, but the header"):
        IndexedDataset(prefix)
    prefix = _ten_documents(tmp_path)
    with open(bin_path(prefix), "ab") as f:
        f.write(b"\x00\x00")  # one token no sequence covers
    with pytest.raises(DataError, match=r"end at token 55, but .*\.bin holds 56 tokens"):
        IndexedDataset(prefix)


def _same_shape_pairs(tmp_path):
    """Two datasets of equal sequence lengths and different tokens: the index checks
    cannot tell one's .bin from the other's."""
    prefixes = []
    for name, seed in (("a", 1), ("b", 2)):
        with IndexedDatasetWriter(tmp_path / name, np.uint16) as w:
            for length in (5, 9, 3):
                w.add_document(np.random.default_rng(seed).integers(0, 999, size=length))
        prefixes.append(tmp_path / name)
    return prefixes


def test_a_bin_and_idx_from_two_writes_are_refused_naming_both(tmp_path):
    a, b = _same_shape_pairs(tmp_path)
    (tmp_path / "b.bin").replace(tmp_path / "a.bin")  # a.idx, b's tokens: as after a race
    with pytest.raises(DataError) as refused:
        IndexedDataset(a)
    message = str(refused.value)
    assert f"{a}.bin and {a}.idx are not one pair" in message and "\n" not in message
    assert f"{a}.pair" in message
    (tmp_path / "a.pair").unlink()  # no record (Megatron's pairs): only the index checks
    assert IndexedDataset(a).num_tokens == 17


def test_the_pair_record_samples_large_files_and_changes_with_any_sampled_block(tmp_path):
    path = tmp_path / "big"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8))
    path.write_bytes(data)
    first = indexed_files.file_fingerprint(str(path))
    data[-1] ^= 1  # the last block is sampled
    path.write_bytes(data)
    assert indexed_files.file_fingerprint(str(path)) != first
    assert first["bytes"] == 1 << 20
