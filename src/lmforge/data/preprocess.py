"""``lmforge preprocess``: raw text files -> Megatron indexed datasets (PREFIX.bin/.idx).

The input formats and their ``file:line`` errors are in :mod:`lmforge.data.readers`; this
module drives the run. Memory stays flat whatever the input size:

* the main process reads each file in blocks of ``--chunk-mb`` cut at line ends and keeps
  at most ``2 x workers`` blocks in flight; the workers parse, check and tokenize them;
* results are written in input order as they arrive (streamed to a temporary
  ``PREFIX.bin``; the per-document lengths spill to a side file), so the peak is about
  ``workers x chunk`` plus a fixed cost, not a multiple of the input;
* the files are renamed to their final names only once complete.

Bad records stop the run with ``file:line: reason`` (for parquet the line is the 1-based
row); ``--on-error skip`` skips them and reports how many and where. Empty or
whitespace-only documents are never an error: they are left out and counted; but an
output left with no document at all is refused, and nothing is written.

One job at a time writes a prefix: a second one is refused, naming the first
(``PREFIX.lock``, which the first removes when it ends).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from lmforge import fsio
from lmforge.data.errors import DataError
from lmforge.data.indexed import IndexedDatasetWriter, token_dtype
from lmforge.data.indexed_files import bin_path, idx_path, pair_path
from lmforge.data.preprocess_work import ChunkResult, init_worker, process_chunk
from lmforge.data.readers import find_inputs, input_kind, iter_chunks
from lmforge.data.tokenizer import TokenizerError, load_tokenizer

_SHOWN_ERRORS = 10

# ------------------------------------------------------------------------ the run

@dataclass
class Output:
    key: str
    prefix: str
    documents: int = 0
    tokens: int = 0
    empty: int = 0


@dataclass
class PreprocessStats:
    outputs: list[Output]
    files: int = 0
    records: int = 0
    seconds: float = 0.0
    skipped: int = 0
    skipped_where: list[str] = field(default_factory=list)
    skipped_per_file: dict[str, int] = field(default_factory=dict)

    @property
    def documents(self) -> int:
        return sum(o.documents for o in self.outputs)

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        lines = []
        for o in self.outputs:
            lines.append(f"wrote {o.prefix}.bin/.idx: {o.documents:,} documents, "
                         f"{o.tokens:,} tokens" + (f" ({o.empty:,} empty documents left out)"
                                                   if o.empty else ""))
        lines.append(f"{self.files} file(s), {self.documents:,} documents, {self.tokens:,} "
                     f"tokens in {self.seconds:.1f} s ({self.tokens_per_s:,.0f} tokens/s)")
        if self.skipped:
            per_file = ", ".join(f"{p}: {n}" for p, n in self.skipped_per_file.items())
            lines.append(f"skipped {self.skipped:,} bad record(s) ({per_file})")
            lines.extend(f"  {w}" for w in self.skipped_where)
            if self.skipped > len(self.skipped_where):
                lines.append(f"  ... and {self.skipped - len(self.skipped_where):,} more")
        return "\n".join(lines)


def output_prefixes(prefix: str, keys: list[str]) -> list[str]:
    """One key: PREFIX; several: PREFIX_{key}_document (Megatron's naming)."""
    if len(keys) == 1:
        return [prefix]
    return [f"{prefix}_{key}_document" for key in keys]


def preprocess(inputs: list[str | Path], output_prefix: str | Path, tokenizer_dir: str | Path,
               json_keys: tuple[str, ...] = ("text",), append_eod: bool = False,
               workers: int = 1, on_error: str = "stop", chunk_mb: float = 1.0,
               progress: bool = False, special_tokens: str = "tokenizer") -> PreprocessStats:
    """Tokenizes ``inputs`` into indexed datasets; returns the counts. Raises DataError.

    ``special_tokens="tokenizer"`` keeps what the tokenizer adds to a text (BOS for
    Llama-2/3, as Megatron-LM's preprocessing does); ``"none"`` keeps the text's tokens
    only. ``append_eod`` then ends each document with the end-of-text token."""
    if on_error not in ("stop", "skip"):
        raise DataError(f"--on-error: {on_error!r} is not one of stop, skip")
    if workers < 1:
        raise DataError(f"--workers: must be >= 1, got {workers}")
    if special_tokens not in ("tokenizer", "none"):
        raise DataError(f"--special-tokens: {special_tokens!r} is not one of tokenizer, none")
    keys = list(dict.fromkeys(json_keys))
    read = [("--input", i) for i in inputs] + [("--tokenizer", tokenizer_dir)]
    for out in output_prefixes(str(output_prefix), keys):
        for path in (bin_path(out), idx_path(out), pair_path(out), f"{out}.lock"):
            fsio.check_apart(path, "--output-prefix", read, within=False)  # never an input
            fsio.check_writable(path, "--output-prefix")
    files = find_inputs(list(inputs))
    if len(keys) > 1 and any(input_kind(f).startswith(".txt") for f in files):
        raise DataError("--json-key: several keys need JSON or parquet inputs "
                        "(a .txt file has no keys)")
    try:
        tok = load_tokenizer(tokenizer_dir)
    except TokenizerError as e:
        raise DataError(f"--tokenizer: {e}") from None
    if append_eod and tok.eos_id is None:
        raise DataError(f"--append-eod: the tokenizer in {tokenizer_dir} has no end-of-text "
                        "token")
    stats = PreprocessStats([Output(k, p) for k, p in
                             zip(keys, output_prefixes(str(output_prefix), keys))],
                            files=len(files))
    with fsio.parent_dirs(output_prefix), _locked([o.prefix for o in stats.outputs]):
        _write(files, keys, tok, stats, str(tokenizer_dir), append_eod, workers, on_error,
               max(4096, int(chunk_mb * (1 << 20))), progress, special_tokens)
    return stats


def _write(files: list[Path], keys: list[str], tok, stats: PreprocessStats,
           tokenizer_dir: str, append_eod: bool, workers: int, on_error: str,
           chunk_bytes: int, progress: bool, special_tokens: str) -> None:
    """Tokenizes ``files`` into ``stats.outputs``' prefixes, counting in ``stats``; nothing
    is left under the final names unless every output holds a document."""
    writers = [IndexedDatasetWriter(o.prefix, token_dtype(tok.vocab_size))
               for o in stats.outputs]
    bar = _progress_bar(sum(f.stat().st_size for f in files), progress)
    start = time.perf_counter()
    text_doc = {"tokens": 0, "content": False}
    prefix, suffix = tok.affixes if special_tokens == "tokenizer" else ([], [])
    text_ends = (prefix, suffix + ([tok.eos_id] if append_eod else []))
    try:
        chunks = iter_chunks(files, keys, chunk_bytes, bar.update if bar else None)
        init = (tokenizer_dir, keys, append_eod, special_tokens == "tokenizer")
        for result in _run(chunks, workers, init):
            _consume(result, stats, writers, on_error, text_ends, text_doc)
            if bar:
                bar.set_postfix(docs=stats.documents, tokens=stats.tokens, refresh=False)
        _refuse_empty(stats, files)
        for w in writers:
            w.finalize()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        if bar:
            bar.close()
    stats.seconds = time.perf_counter() - start


@contextlib.contextmanager
def _locked(prefixes: list[str]) -> Iterator[None]:
    """One job at a time per output prefix (``PREFIX.lock``, removed at the end): two jobs
    renaming their .bin and .idx into one place could leave one's .bin with the other's
    .idx."""
    locks: list[fsio.FileLock] = []
    try:
        for prefix in prefixes:
            lock = fsio.FileLock(f"{prefix}.lock", remove=True)
            try:
                lock.acquire()
            except fsio.LockHeld as e:
                raise DataError(f"--output-prefix: {prefix} is being written by another "
                                f"preprocess ({fsio.describe_holder(e.holder)}; lock file "
                                f"{lock.path}); wait for it or choose another prefix") from None
            except OSError as e:
                raise DataError(f"--output-prefix: cannot create {lock.path} "
                                f"({e.strerror or e})") from None
            locks.append(lock)
        yield
    finally:
        for lock in reversed(locks):
            lock.release()


def _refuse_empty(stats: PreprocessStats, files: list[Path]) -> None:
    """A dataset of no document is a mistake (an empty input, the wrong --json-key):
    refused before anything is written."""
    for o in stats.outputs:
        if o.documents:
            continue
        key = f" under key {o.key!r}" if len(stats.outputs) > 1 else ""
        why = [f"{o.empty:,} empty documents left out"] if o.empty else []
        why += [f"{stats.skipped:,} bad records skipped"] if stats.skipped else []
        named = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more files"
                                                   if len(files) > 3 else "")
        raise DataError(f"--input {named}: no documents{key} to write "
                        f"({', '.join(why) or 'no records'}); nothing written")


def _run(chunks: Iterator[tuple], workers: int, init: tuple) -> Iterator[ChunkResult]:
    """Results in input order; at most 2 x workers chunks in flight."""
    if workers == 1:
        init_worker(*init)
        yield from map(process_chunk, chunks)
        return
    # spawn: workers start clean (no copied parent memory, no forked tokenizer threads)
    pool = mp.get_context("spawn").Pool(workers, initializer=init_worker, initargs=init)
    try:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(process_chunk, (chunk,)))
            while len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _consume(r: ChunkResult, stats: PreprocessStats, writers: list, on_error: str,
             text_ends: tuple[list, list], text_doc: dict) -> None:
    stats.records += r.records
    for line, reason in r.errors:
        if on_error == "stop":
            raise DataError(f"{r.path}:{line}: {reason}")
        stats.skipped += 1
        stats.skipped_per_file[r.path] = stats.skipped_per_file.get(r.path, 0) + 1
        if len(stats.skipped_where) < _SHOWN_ERRORS:
            stats.skipped_where.append(f"{r.path}:{line}: {reason}")
    if r.final is not None:  # a piece of a .txt document
        _consume_text(r, stats.outputs[0], writers[0], text_ends, text_doc)
        return
    for out, w, tokens, lengths, empty in zip(stats.outputs, writers, r.tokens, r.lengths,
                                              r.empty):
        w.add_documents(tokens, lengths)
        out.documents += len(lengths)
        out.tokens += int(tokens.size)
        out.empty += empty


def _consume_text(r: ChunkResult, out: Output, w: IndexedDatasetWriter,
                  ends: tuple[list, list], doc: dict) -> None:
    """Pieces of one .txt document: ``ends`` = (ids before it, ids after it)."""
    if r.errors:  # (skip mode) a bad piece drops the whole document
        doc["bad"] = True
    elif not doc.get("bad"):
        if not doc.get("started"):
            w.write(np.asarray(ends[0]))
            doc["tokens"] += len(ends[0])
            doc["started"] = True
        w.write(r.tokens[0])
        doc["tokens"] += int(r.tokens[0].size)
        doc["content"] |= not r.blank
    if not r.final:
        return
    if doc.get("bad") or not doc["content"]:
        w.discard_open_sequence()
        out.empty += not doc.get("bad")
    else:
        w.write(np.asarray(ends[1]))
        doc["tokens"] += len(ends[1])
        w.end_document()
        out.documents += 1
        out.tokens += doc["tokens"]
    doc.update(tokens=0, content=False, bad=False, started=False)


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                desc="preprocess", dynamic_ncols=True)


__all__ = ["preprocess", "output_prefixes", "PreprocessStats"]
