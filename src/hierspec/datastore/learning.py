"""A model store that keeps learning: finished generations add their n-grams, verification forwards their top-k
successors, and the store is rewritten in versions that readers never see half-written.

The directory is an ordinary model store (kind ``model``, :class:`~hierspec.datastore.ngram.NgramTable` reads it)
whose array files carry a version number — ``ngrams-000007.tokens``, ``ngrams-000007.counts``,
``successors-000007.i32`` (the :class:`~hierspec.datastore.successors.SuccessorTable`) — and whose header names the
current version. A flush merges the pending generations' grams into the counts (each gram counted once per
generation, as the builder counts them), keeps the ``max_grams`` most frequent (count-based eviction), writes the
next version's files under temporary names, renames them, and then replaces the header atomically. Files of the
version before stay until the next flush, so a reader that read the previous header still finds its files; a
writer killed at any point leaves the previous version readable. Writers take the directory's build lock and skip a
flush (keeping their pending generations, at most :data:`MAX_PENDING`) while another process holds it.

Learning never fails a generation: a store that cannot be written (read-only, full, over quota, no permission)
turns learning off for that store with one warning and keeps serving the drafts it holds; a failed flush leaves no
files behind. :attr:`LearningStore.problem` says why learning stopped (the server's ``/health`` reports it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

import numpy as np

from hierspec.datastore.format import (
    DatastoreError,
    check_tokenizer,
    new_header,
    read_header,
    token_dtype,
    write_array,
    write_header,
)
from hierspec.datastore.ngram import KIND, NgramTable, count_ngrams, top_ngrams
from hierspec.datastore.output import build_lock
from hierspec.datastore.successors import SuccessorTable, stored_successors
from hierspec.storage import storage_problem, unwritable_reason

log = logging.getLogger(__name__)

#: generations held for the next flush at most (the oldest are dropped when flushes keep being postponed)
MAX_PENDING = 256

_VERSIONED = re.compile(r"^(ngrams|successors)-(\d{6})\.(tokens|counts|i32)$")


class LearningStore:
    """An n-gram table and a successor table that grow with every generation and are persisted in versions."""

    def __init__(self, directory: Path, header: dict, table: NgramTable, successors: SuccessorTable,
                 max_grams: int) -> None:
        self.directory = directory
        self.header = header
        self.table = table
        self.successors = successors
        self.max_grams = max_grams
        self._pending: list[np.ndarray] = []
        self._flushed_successors = successors.table.copy()  # what the last version held: rows changed since are ours
        #: why learning into this store was turned off (``None`` while it learns)
        self.problem: str | None = None

    @classmethod
    def open(cls, directory: str | Path, tokenizer_name: str, fingerprint: str, vocab_size: int,
             key_len: int = 1, value_len: int = 4, max_grams: int = 200_000, successor_k: int = 8) -> LearningStore:
        """Open a model store to learn into, or create an empty one; a store of another tokenizer is refused.

        A store that cannot be created raises :class:`DatastoreError` naming the directory and the cause; an
        existing one that cannot be written opens with learning turned off (:attr:`problem`) and a warning.
        """
        directory = Path(directory)
        if not (directory / "header.json").is_file():
            try:
                _write_version(directory, np.empty((0, key_len + value_len), dtype=np.int64),
                               np.empty(0, dtype=np.int64), SuccessorTable(vocab_size, successor_k), 1,
                               tokenizer_name, fingerprint, vocab_size, key_len, max_grams, generations=0)
            except OSError as exc:
                raise DatastoreError(f"cannot create the learning store {directory}: {storage_problem(exc)}; "
                                     "pass a writable directory (or learn=false)") from exc
        header = read_header(directory, kind=KIND)
        check_tokenizer(header, directory, fingerprint, tokenizer_name)
        table = NgramTable.open(directory)
        successors = SuccessorTable(vocab_size, successor_k)
        stored = stored_successors(directory, header)
        if stored is not None and stored.shape == (vocab_size, successor_k):
            successors = SuccessorTable(vocab_size, successor_k, np.asarray(stored))
        store = cls(directory, header, table, successors, max_grams)
        reason = unwritable_reason(directory)
        if reason is not None:
            store._stop_learning(reason)
        return store

    @property
    def version(self) -> int:
        return int(self.header.get("learning", {}).get("version", 0))

    @property
    def pending(self) -> int:
        """Generations added since the last flush."""
        return len(self._pending)

    def add_generation(self, tokens: np.ndarray) -> None:
        """Queue one generation's tokens (the key's context first) for the next flush (nothing once learning is
        off)."""
        if self.problem is None and tokens.shape[0] >= self.table.key_len + self.table.value_len:
            self._pending.append(np.asarray(tokens, dtype=np.int64).copy())
            del self._pending[:-MAX_PENDING]

    def flush(self) -> bool:
        """Merge the pending generations into a new version; False when another writer holds the lock (pending
        kept) or the store cannot be written (learning turned off, pending dropped)."""
        if self.problem is not None:
            return False
        try:
            with build_lock(self.directory.resolve()):
                self._write_next_version()
        except DatastoreError as exc:
            if "another build" not in str(exc):
                raise
            log.info("learning store %s is being written by another process; flush postponed", self.directory)
            return False
        except OSError as exc:
            self._stop_learning(storage_problem(exc))
            return False
        return True

    def _merge_successors(self, header: dict) -> None:
        """Take the successor rows another writer stored since our last flush, keeping the rows we changed."""
        stored = stored_successors(self.directory, header)
        if stored is None or stored.shape != self.successors.table.shape:
            return
        ours = (self.successors.table != self._flushed_successors).any(axis=1)
        self.successors.table[~ours] = stored[~ours]

    def _stop_learning(self, reason: str) -> None:
        self.problem = f"learning into {self.directory} is off: {reason}"
        self._pending.clear()
        log.warning("%s; drafting goes on with what the store holds", self.problem)

    def _write_next_version(self) -> None:
        header = read_header(self.directory, kind=KIND)  # another process may have flushed meanwhile
        current = NgramTable.open(self.directory)
        n = current.key_len + current.value_len
        grams, counts = count_ngrams(self._pending, n)
        old_grams, old_counts = current.grams_and_counts()
        merged, index = np.unique(np.concatenate([old_grams, grams]), axis=0, return_inverse=True)
        merged_counts = np.bincount(index.ravel(), weights=np.concatenate([old_counts, counts]),
                                    minlength=merged.shape[0]).astype(np.int64)
        merged, merged_counts = top_ngrams(merged, merged_counts, self.max_grams, current.key_len)
        self._merge_successors(header)
        learning = header.get("learning", {})
        version = int(learning.get("version", 0)) + 1
        _write_version(self.directory, merged, merged_counts, self.successors, version, header["tokenizer"]["name"],
                       header["tokenizer"]["fingerprint"], int(header["vocab_size"]), current.key_len,
                       self.max_grams, generations=int(learning.get("generations", 0)) + len(self._pending))
        _remove_old_versions(self.directory, version)
        self._flushed_successors = self.successors.table.copy()
        self._pending.clear()
        self.header = read_header(self.directory, kind=KIND)
        self.table = NgramTable.open(self.directory)


def _write_version(directory: Path, grams: np.ndarray, counts: np.ndarray, successors: SuccessorTable, version: int,
                   tokenizer_name: str, fingerprint: str, vocab_size: int, key_len: int, max_grams: int,
                   generations: int) -> None:
    """Write one version's arrays, then the header naming them; on any failure remove what this call wrote (the
    header still names the version before, so nothing written here is needed)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {"tokens": (f"ngrams-{version:06d}.tokens", grams.astype(token_dtype(vocab_size))),
             "counts": (f"ngrams-{version:06d}.counts", counts.astype(np.uint32)),
             "successors": (f"successors-{version:06d}.i32", successors.table.astype(np.int32))}
    try:
        arrays = {}
        for key, (name, array) in files.items():
            temporary = f".{name}.tmp"
            entry = write_array(directory, temporary, array)
            os.replace(directory / temporary, directory / name)
            arrays[key] = {**entry, "file": name}
        header = new_header(KIND, tokenizer_name, fingerprint, vocab_size=vocab_size, token_dtype=token_dtype(
            vocab_size).name, key_len=key_len, value_len=int(grams.shape[1]) - key_len, num_grams=int(grams.shape[0]),
            arrays=arrays, learning={"version": version, "max_grams": max_grams, "generations": generations,
                                     "successor_k": successors.k})
        write_header(directory, header)
    except BaseException:
        for name, _ in files.values():
            for path in (directory / f".{name}.tmp", directory / name):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
        raise


def _remove_old_versions(directory: Path, version: int) -> None:
    """Delete the files of versions before ``version - 1`` (the builder's unversioned table counts as version 0)."""
    for path in directory.iterdir():
        match = _VERSIONED.match(path.name)
        stale = int(match.group(2)) < version - 1 if match else (
            path.name in {"ngrams.tokens", "ngrams.counts"} and version >= 2)
        if stale:
            path.unlink(missing_ok=True)
