"""N-gram table: the model-dependent store of Hierarchy Drafting (``D_m``).

The table holds the ``top_k`` most frequent ``(l + m)``-grams of a set of documents (the target model's own
generations), each counted at most once per document. A gram's first ``l`` tokens are its key, the next ``m`` its
value; a key's values are ranked by count.

Layout of a store directory (besides the builder's ``generations.jsonl`` and ``build.json``)::

    header.json        magic, version, kind "model", tokenizer name + fingerprint, l, m, counts
    ngrams.tokens      [grams, l + m] token ids, sorted by key, then count (descending), then value
    ngrams.counts      [grams] uint32 document counts
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from hierspec.datastore.format import (
    DatastoreError,
    check_tokenizer,
    header_dict,
    header_int,
    new_header,
    open_array,
    read_header,
    token_dtype,
    write_array,
    write_header,
)
from hierspec.datastore.successors import UNKNOWN, stored_successors
from hierspec.errors import InputError

KIND = "model"


def count_ngrams(documents: Iterable[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ``n``-grams of the documents and the number of documents each occurs in.

    Returns ``(grams [g, n] int64, counts [g] int64)`` with grams in lexicographic order.

    Example: documents ``[1, 2, 1, 2]`` and ``[1, 2, 3]`` with ``n = 2`` give grams ``[1, 2], [2, 1], [2, 3]``
    with counts ``2, 1, 1`` (``[1, 2]`` occurs twice in the first document but counts once there).
    """
    per_doc = []
    for doc in documents:
        doc = np.asarray(doc, dtype=np.int64)
        if doc.shape[0] >= n:
            windows = np.lib.stride_tricks.sliding_window_view(doc, n)
            per_doc.append(np.unique(windows, axis=0))
    if not per_doc:
        return np.empty((0, n), dtype=np.int64), np.empty(0, dtype=np.int64)
    grams, counts = np.unique(np.concatenate(per_doc), axis=0, return_counts=True)
    return grams, counts.astype(np.int64)


def top_ngrams(grams: np.ndarray, counts: np.ndarray, top_k: int, key_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``top_k`` most frequent grams, re-sorted by key, then count (descending), then value.

    Ties at the cut-off are broken by lexicographic order, so the table is deterministic.
    """
    if top_k < grams.shape[0]:
        # lexsort: last key is primary — count descending, then the gram's lexicographic order
        order = np.lexsort((np.arange(grams.shape[0]), -counts))[:top_k]
        grams, counts = grams[order], counts[order]
    columns = [grams[:, j] for j in range(grams.shape[1] - 1, key_len - 1, -1)]
    order = np.lexsort((*columns, -counts, *[grams[:, j] for j in range(key_len - 1, -1, -1)]))
    return grams[order], counts[order]


def write_ngram_table(
    out_dir: str | Path,
    grams: np.ndarray,
    counts: np.ndarray,
    key_len: int,
    vocab_size: int,
    tokenizer_name: str,
    fingerprint: str,
    **fields,
) -> dict:
    """Write the table files and then the header (each through a temporary file renamed into place)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    entries = {
        "tokens": _write_atomically(out_dir, "ngrams.tokens", grams.astype(dtype)),
        "counts": _write_atomically(out_dir, "ngrams.counts", counts.astype(np.uint32)),
    }
    header = new_header(
        KIND, tokenizer_name, fingerprint, vocab_size=vocab_size, token_dtype=dtype.name, key_len=key_len,
        value_len=int(grams.shape[1]) - key_len, num_grams=int(grams.shape[0]), arrays=entries, **fields,
    )
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".header-") as tmp:
        write_header(Path(tmp), header)
        os.replace(Path(tmp) / "header.json", out_dir / "header.json")
    return header


def _write_atomically(directory: Path, name: str, array: np.ndarray) -> dict:
    with tempfile.TemporaryDirectory(dir=directory, prefix=f".{name}-") as tmp:
        entry = write_array(Path(tmp), name, array)
        os.replace(Path(tmp) / name, directory / name)
    return entry


class NgramTable:
    """An opened model-dependent store: key (``l`` tokens) → continuations ranked by document count."""

    def __init__(self, directory: Path, header: dict, grams: np.ndarray, counts: np.ndarray,
                 top_k: int | None = None) -> None:
        self.directory = directory
        self.header = header
        self.key_len = int(header["key_len"])
        self.value_len = int(header["value_len"])
        if top_k is not None and top_k < counts.shape[0]:
            keep = np.sort(np.lexsort((np.arange(counts.shape[0]), -np.asarray(counts, dtype=np.int64)))[:top_k])
            grams, counts = grams[keep], counts[keep]
        self._grams, self._all_counts = grams, counts
        self._values = np.asarray(grams[:, self.key_len :], dtype=np.int64)
        self._counts = np.asarray(counts, dtype=np.int64)
        self._slices = _key_slices(np.asarray(grams[:, : self.key_len], dtype=np.int64))

    @classmethod
    def open(cls, directory: str | Path, fingerprint: str | None = None, tokenizer_name: str = "",
             top_k: int | None = None) -> NgramTable:
        """Open and validate a table; with ``fingerprint``, refuse one built with another tokenizer.

        ``top_k`` keeps only the most frequent grams (ties: table order). The table is small (the most frequent
        grams only), so opening checks every token id against the vocabulary.
        """
        directory = Path(directory)
        header = read_header(directory, kind=KIND)
        if fingerprint is not None:
            check_tokenizer(header, directory, fingerprint, tokenizer_name)
        key_len = header_int(header, "key_len", directory, minimum=1)
        value_len = header_int(header, "value_len", directory, minimum=1)
        vocab_size = header_int(header, "vocab_size", directory, minimum=1)
        arrays = header_dict(header, "arrays", directory)
        grams = open_array(directory, arrays.get("tokens"), ("<u2", "<u4"), ndim=2)
        counts = open_array(directory, arrays.get("counts"), ("<u4",), ndim=1)
        if grams.shape[1] != key_len + value_len or counts.shape != (grams.shape[0],):
            raise DatastoreError(f"{directory}: table shapes disagree with the header; rebuild the datastore")
        if grams.size and int(grams.max()) >= vocab_size:
            raise DatastoreError(f"{directory} holds token ids outside the vocabulary of {vocab_size}; rebuild it")
        return cls(directory, header, grams, counts, top_k)

    def verify(self) -> dict:
        """The checks :meth:`open` does not make: counts positive, and a learning store's successor table whole
        (``[vocab, k]`` int32, entries token ids or unknown)."""
        if self._counts.size and int(self._counts.min()) < 1:
            raise DatastoreError(f"{self.directory}: a gram has count 0; rebuild the datastore")
        successors = stored_successors(self.directory, self.header)
        if successors is not None:
            vocab = int(self.header.get("vocab_size", 0))
            if successors.shape[0] != vocab or successors.size and (
                    int(successors.min()) < UNKNOWN or int(successors.max()) >= vocab):
                raise DatastoreError(f"{self.directory}: the successor table holds entries outside the vocabulary "
                                     f"of {vocab} tokens; delete the store's successors file or rebuild the store")
        return {"grams": len(self), "keys": len(self._slices), "ok": True}

    def grams_and_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Every ``(l + m)``-gram held and its document count, as int64 arrays (``[g, l + m]``, ``[g]``)."""
        return np.asarray(self._grams, dtype=np.int64), np.asarray(self._all_counts, dtype=np.int64)

    def __len__(self) -> int:
        return int(self._counts.shape[0])

    def lookup(self, key: np.ndarray, limit: int, min_count: int = 1, min_share: float = 0.0) -> list[np.ndarray]:
        """Up to ``limit`` values stored under the last ``key_len`` tokens of ``key``, most frequent first.

        Values seen in fewer than ``min_count`` documents, or holding less than ``min_share`` of the key's total
        count, are left out.
        """
        return [value for value, _ in self.lookup_shares(key, limit, min_count, min_share)]

    def lookup_shares(self, key: np.ndarray, limit: int, min_count: int = 1,
                      min_share: float = 0.0) -> list[tuple[np.ndarray, float]]:
        """:meth:`lookup` with each value's share of its key's total count."""
        if key.shape[0] < self.key_len or limit <= 0:
            return []
        span = self._slices.get(tuple(int(t) for t in key[-self.key_len :]))
        if span is None:
            return []
        start, end = span
        total = float(self._counts[start:end].sum())
        threshold = max(min_count, min_share * total)
        end = min(end, start + limit)
        return [(self._values[i], float(self._counts[i]) / total) for i in range(start, end)
                if self._counts[i] >= threshold]

    def info(self) -> dict:
        """Header plus on-disk size."""
        size = sum(f.stat().st_size for f in self.directory.iterdir() if f.is_file())
        return {**self.header, "bytes_on_disk": size}


def _key_slices(keys: np.ndarray) -> dict[tuple[int, ...], tuple[int, int]]:
    """Row range of each distinct key in a key-sorted array."""
    if keys.shape[0] == 0:
        return {}
    starts = np.flatnonzero(np.concatenate([[True], (keys[1:] != keys[:-1]).any(axis=1)]))
    ends = np.append(starts[1:], keys.shape[0])
    return {tuple(keys[s].tolist()): (int(s), int(e)) for s, e in zip(starts, ends)}


def check_gram_shape(key_len: int, value_len: int, top_k: int) -> None:
    """Validate n-gram table parameters."""
    if key_len < 1 or value_len < 1:
        raise InputError("the model store needs key length l >= 1 and value length m >= 1")
    if top_k < 1:
        raise InputError("the model store needs top_k >= 1")
