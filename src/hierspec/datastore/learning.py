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
flush (keeping their pending generations) while another process holds it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import numpy as np

from hierspec.datastore.format import (
    DatastoreError,
    check_tokenizer,
    new_header,
    open_array,
    read_header,
    token_dtype,
    write_array,
    write_header,
)
from hierspec.datastore.ngram import KIND, NgramTable, count_ngrams, top_ngrams
from hierspec.datastore.output import build_lock
from hierspec.datastore.successors import SuccessorTable

log = logging.getLogger(__name__)

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

    @classmethod
    def open(cls, directory: str | Path, tokenizer_name: str, fingerprint: str, vocab_size: int,
             key_len: int = 1, value_len: int = 4, max_grams: int = 200_000, successor_k: int = 8) -> LearningStore:
        """Open a model store to learn into, or create an empty one; a store of another tokenizer is refused."""
        directory = Path(directory)
        if not (directory / "header.json").is_file():
            _write_version(directory, np.empty((0, key_len + value_len), dtype=np.int64), np.empty(0, dtype=np.int64),
                           SuccessorTable(vocab_size, successor_k), 1, tokenizer_name, fingerprint, vocab_size,
                           key_len, max_grams, generations=0)
        header = read_header(directory, kind=KIND)
        check_tokenizer(header, directory, fingerprint, tokenizer_name)
        table = NgramTable.open(directory)
        successors = SuccessorTable(vocab_size, successor_k)
        entry = header.get("arrays", {}).get("successors")
        if entry is not None:
            stored = open_array(directory, entry, ("<i4",), ndim=2)
            if stored.shape == (vocab_size, successor_k):
                successors = SuccessorTable(vocab_size, successor_k, np.asarray(stored))
        return cls(directory, header, table, successors, max_grams)

    @property
    def version(self) -> int:
        return int(self.header.get("learning", {}).get("version", 0))

    @property
    def pending(self) -> int:
        """Generations added since the last flush."""
        return len(self._pending)

    def add_generation(self, tokens: np.ndarray) -> None:
        """Queue one generation's tokens (the key's context first) for the next flush."""
        if tokens.shape[0] >= self.table.key_len + self.table.value_len:
            self._pending.append(np.asarray(tokens, dtype=np.int64).copy())

    def flush(self) -> bool:
        """Merge the pending generations into a new version; False (pending kept) when another writer holds the
        lock."""
        try:
            with build_lock(self.directory.resolve()):
                self._write_next_version()
        except DatastoreError as exc:
            if "another build" not in str(exc):
                raise
            log.info("learning store %s is being written by another process; flush postponed", self.directory)
            return False
        return True

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
        learning = header.get("learning", {})
        version = int(learning.get("version", 0)) + 1
        _write_version(self.directory, merged, merged_counts, self.successors, version, header["tokenizer"]["name"],
                       header["tokenizer"]["fingerprint"], int(header["vocab_size"]), current.key_len,
                       self.max_grams, generations=int(learning.get("generations", 0)) + len(self._pending))
        _remove_old_versions(self.directory, version)
        self._pending.clear()
        self.header = read_header(self.directory, kind=KIND)
        self.table = NgramTable.open(self.directory)


def _write_version(directory: Path, grams: np.ndarray, counts: np.ndarray, successors: SuccessorTable, version: int,
                   tokenizer_name: str, fingerprint: str, vocab_size: int, key_len: int, max_grams: int,
                   generations: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    files = {"tokens": (f"ngrams-{version:06d}.tokens", grams.astype(token_dtype(vocab_size))),
             "counts": (f"ngrams-{version:06d}.counts", counts.astype(np.uint32)),
             "successors": (f"successors-{version:06d}.i32", successors.table.astype(np.int32))}
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


def _remove_old_versions(directory: Path, version: int) -> None:
    """Delete the files of versions before ``version - 1`` (the builder's unversioned table counts as version 0)."""
    for path in directory.iterdir():
        match = _VERSIONED.match(path.name)
        stale = int(match.group(2)) < version - 1 if match else (
            path.name in {"ngrams.tokens", "ngrams.counts"} and version >= 2)
        if stale:
            path.unlink(missing_ok=True)
