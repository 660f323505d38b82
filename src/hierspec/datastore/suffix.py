"""Suffix-array datastore (REST's statistics-dependent store): build it from a corpus, open it, query it.

Layout of a store directory::

    header.json            magic, version, kind "suffix", tokenizer name + fingerprint, counts, shard list
    shard-000.tokens       documents' token ids, each document followed by the separator (dtype's max value)
    shard-000.sa           suffix array of shard-000.tokens (int32; int64 beyond 2^31 tokens)

Shards are searched together; each holds at most ``shard_tokens`` tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hierspec.datastore.format import (
    DatastoreError,
    check_tokenizer,
    header_int,
    new_header,
    open_array,
    read_header,
    separator_id,
    token_dtype,
    write_array,
    write_header,
)
from hierspec.datastore.output import build_output
from hierspec.datastore.suffix_search import (
    as_pattern,
    first_bad_token,
    gather_continuations,
    sa_range,
    sa_range_within,
    suffix_array_fault,
)
from hierspec.errors import InputError

log = logging.getLogger(__name__)

KIND = "suffix"
_INT32_LIMIT = np.iinfo(np.int32).max
_TOKEN_DTYPES = ("<u2", "<u4")
_SA_DTYPES = ("<i4", "<i8")


@dataclass(frozen=True)
class SuffixBuildConfig:
    """Builder settings.

    Attributes:
        batch_size: documents tokenized per call (fast tokenizers spread a batch over all cores).
        shard_tokens: most tokens in one shard (its suffix array stays int32 below 2^31).
    """

    batch_size: int = 1000
    shard_tokens: int = _INT32_LIMIT

    def __post_init__(self) -> None:
        if self.batch_size <= 0 or not 1 <= self.shard_tokens <= np.iinfo(np.int64).max:
            raise InputError("batch_size and shard_tokens must be positive")


def _batches(documents: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Suffix array of a token array (pydivsufsort), int32 when it fits, else int64."""
    from pydivsufsort import divsufsort

    sa = divsufsort(np.ascontiguousarray(tokens), force64=tokens.shape[0] > _INT32_LIMIT)
    return sa.astype(np.int32 if tokens.shape[0] <= _INT32_LIMIT else np.int64, copy=False)


def build_suffix_store(
    documents: Iterable[str],
    tokenizer,
    tokenizer_name: str,
    fingerprint: str,
    out_dir: str | Path,
    config: SuffixBuildConfig | None = None,
    sources: list[str] | None = None,
    overwrite: bool = False,
) -> dict:
    """Tokenize documents and write a suffix-array store atomically; return its header."""
    config = config or SuffixBuildConfig()
    dtype = token_dtype(len(tokenizer))
    separator = separator_id(dtype)
    start = time.perf_counter()
    with build_output(out_dir, overwrite=overwrite) as tmp:
        shards: list[dict] = []
        pending: list[np.ndarray] = []
        pending_tokens = 0
        num_docs = 0
        progress = tqdm(desc="tokenizing", unit="doc")
        for batch in _batches(documents, config.batch_size):
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                if not ids:
                    continue
                doc = np.empty(len(ids) + 1, dtype=dtype)
                doc[:-1] = ids
                doc[-1] = separator
                if pending and pending_tokens + doc.shape[0] > config.shard_tokens:
                    shards.append(_write_shard(tmp, len(shards), pending))
                    pending, pending_tokens = [], 0
                pending.append(doc)
                pending_tokens += doc.shape[0]
                num_docs += 1
            progress.update(len(batch))
            progress.set_postfix(tokens=sum(s["num_tokens"] for s in shards) + pending_tokens)
        progress.close()
        if pending:
            shards.append(_write_shard(tmp, len(shards), pending))
        if not shards:
            raise InputError("the inputs hold no text to index")
        num_tokens = sum(s["num_tokens"] for s in shards)
        header = new_header(
            KIND, tokenizer_name, fingerprint,
            vocab_size=len(tokenizer), token_dtype=dtype.name, separator=separator, num_tokens=num_tokens,
            num_documents=num_docs, shards=shards, sources=sources or [],
            build_seconds=round(time.perf_counter() - start, 3),
        )
        write_header(tmp, header)
    return header


def _write_shard(directory: Path, index: int, docs: list[np.ndarray]) -> dict:
    tokens = np.concatenate(docs)
    log.info("indexing shard %d (%d tokens)", index, tokens.shape[0])
    with tqdm(total=1, desc=f"suffix array shard {index}", unit="shard") as bar:
        sa = suffix_array(tokens)
        bar.update(1)
    return {
        "num_tokens": int(tokens.shape[0]),
        "tokens": write_array(directory, f"shard-{index:03d}.tokens", tokens),
        "suffix_array": write_array(directory, f"shard-{index:03d}.sa", sa),
    }


@dataclass(frozen=True)
class Match:
    """Result of a longest-suffix lookup: the matched length and the suffix-array row range in each shard."""

    length: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def count(self) -> int:
        """Occurrences of the matched suffix in the whole store."""
        return sum(hi - lo for lo, hi in self.ranges)


class SuffixStore:
    """A suffix-array store opened by memory map (nothing is copied into RAM).

    Opening checks everything that is cheap (header fields and types, file names, dtypes, sizes); :meth:`verify`
    reads every array. The search kernels never read outside their arrays, so even a store whose arrays were
    corrupted after it was built yields wrong drafts (which verification rejects), never a crash.
    """

    def __init__(self, directory: Path, header: dict, shards: list[tuple[np.ndarray, np.ndarray]],
                 vocab_size: int, separator: int) -> None:
        self.directory = directory
        self.header = header
        self.shards = shards
        self.vocab_size = vocab_size
        self.separator = separator
        # per shard: a token -> the rows of the suffixes it starts, filled as tokens are searched (a search then
        # starts inside its first token's rows: fewer random reads of the memory-mapped arrays)
        self._first_rows: list[dict[int, tuple[int, int]]] = [{} for _ in shards]

    @classmethod
    def open(cls, directory: str | Path, fingerprint: str | None = None, tokenizer_name: str = "") -> SuffixStore:
        """Open and validate a store; with ``fingerprint``, refuse a store built with another tokenizer."""
        directory = Path(directory)
        header = read_header(directory, kind=KIND)
        if fingerprint is not None:
            check_tokenizer(header, directory, fingerprint, tokenizer_name)
        vocab_size = header_int(header, "vocab_size", directory, minimum=1)
        separator = header_int(header, "separator", directory)
        total = header_int(header, "num_tokens", directory)
        entries = header.get("shards")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise DatastoreError(f"{directory}/header.json: shards must be a non-empty list; the header is corrupt")
        shards = [(open_array(directory, e.get("tokens"), _TOKEN_DTYPES, ndim=1),
                   open_array(directory, e.get("suffix_array"), _SA_DTYPES, ndim=1)) for e in entries]
        for tokens, sa in shards:
            if tokens.shape != sa.shape:
                raise DatastoreError(f"{directory}: a token file and its suffix array differ in length; rebuild")
            if separator != separator_id(tokens.dtype) or vocab_size > separator:
                raise DatastoreError(f"{directory}: separator {separator} and vocab_size {vocab_size} do not fit the "
                                     f"token dtype {tokens.dtype}; the header is corrupt")
        if sum(t.shape[0] for t, _ in shards) != total:
            raise DatastoreError(f"{directory}: num_tokens {total} differs from the shards' lengths; rebuild")
        for index, (tokens, sa) in enumerate(shards):
            fault = bounds_fault(tokens, sa, vocab_size, separator)
            if fault:
                raise DatastoreError(f"{directory}: shard {index}: {fault}; the store is damaged, rebuild it "
                                     "(`hierspec datastore info --verify` checks it whole)")
        return cls(directory, header, shards, vocab_size, separator)

    def verify(self) -> dict:
        """Read every array: token ids in the vocabulary (or the separator), each suffix array a sorted permutation
        of its shard's positions. Raises :class:`DatastoreError` at the first fault; returns what was checked."""
        for index, (tokens, sa) in enumerate(tqdm(self.shards, desc="verifying shards", unit="shard")):
            where = f"{self.directory}: shard {index}"
            if tokens.shape[0] and tokens[-1] != self.separator:
                raise DatastoreError(f"{where} does not end with the document separator")
            bad = first_bad_token(tokens, self.vocab_size, self.separator)
            if bad >= 0:
                raise DatastoreError(f"{where} holds token id {int(tokens[bad])} at position {bad}, outside the "
                                     f"vocabulary of {self.vocab_size}")
            fault = suffix_array_fault(tokens, sa)
            if fault:
                raise DatastoreError(f"{where}: {fault}; rebuild the datastore")
        return {"shards": len(self.shards), "tokens": self.num_tokens, "ok": True}

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id below ``vocab_size`` occurs in the store's documents (int64 ``[vocab_size]``)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for tokens, _ in self.shards:
            ids = np.asarray(tokens)
            counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)[:vocab_size]
        return counts

    @property
    def num_tokens(self) -> int:
        return int(self.header["num_tokens"])

    def longest_match(self, context: np.ndarray, n_max: int, n_min: int) -> Match | None:
        """The longest suffix of ``context`` (from ``n_max`` tokens down to ``n_min``) found in the store.

        Every suffix of a suffix that occurs occurs too, so the length is bisected: about log2(n_max - n_min) + 1
        searches instead of one per length (a search is ~50 random reads of the memory-mapped arrays, which a
        decoding step's weights have evicted from the caches)."""
        context = as_pattern(context[-n_max:])
        longest = min(n_max, context.shape[0])
        if longest < n_min:
            return None
        ranges = self._ranges(context[-n_min:])
        if ranges is None:
            return None
        found, low, high = Match(n_min, ranges), n_min + 1, longest
        while low <= high:
            n = (low + high) // 2
            ranges = self._ranges(context[-n:])
            if ranges is None:
                high = n - 1
            else:
                found, low = Match(n, ranges), n + 1
        return found

    def _ranges(self, pattern: np.ndarray) -> tuple[tuple[int, int], ...] | None:
        """Each shard's suffix-array rows starting with ``pattern``, or ``None`` where no shard holds it."""
        ranges = tuple(sa_range_within(tokens, sa, pattern, *self._rows_of_first(index, int(pattern[0])))
                       for index, (tokens, sa) in enumerate(self.shards))
        return ranges if any(hi > lo for lo, hi in ranges) else None

    def _rows_of_first(self, shard: int, token: int) -> tuple[int, int]:
        """The rows of shard ``shard``'s suffixes that start with ``token`` (searched once, then remembered)."""
        rows = self._first_rows[shard].get(token)
        if rows is None:
            tokens, sa = self.shards[shard]
            rows = self._first_rows[shard][token] = sa_range(tokens, sa, np.array([token], dtype=np.int64))
        return rows

    def continuations(self, match: Match, k: int, m: int) -> np.ndarray:
        """Up to ``k`` continuations of ``m`` tokens after the match, spread over shards by their share of hits.

        Returns an int64 array ``[rows, m]`` padded with ``-1`` where a continuation meets a document end.
        """
        total = match.count
        parts = []
        for (tokens, sa), (lo, hi) in zip(self.shards, match.ranges):
            if hi > lo:
                share = max(1, (k * (hi - lo)) // total)
                parts.append(gather_continuations(tokens, sa, lo, hi, match.length, share, m, self.separator,
                                                  self.vocab_size))
        return np.concatenate(parts) if parts else np.empty((0, m), dtype=np.int64)

    def info(self) -> dict:
        """Header plus on-disk sizes."""
        size = sum(f.stat().st_size for f in self.directory.iterdir() if f.is_file())
        return {**self.header, "bytes_on_disk": size,
                "bytes_per_token": size / self.num_tokens if self.num_tokens else 0.0}


#: elements per vectorized pass of :func:`bounds_fault` (bounded temporary memory)
_BOUNDS_CHUNK = 1 << 24


def bounds_fault(tokens: np.ndarray, sa: np.ndarray, vocab_size: int, separator: int) -> str | None:
    """The checks cheap enough for every open (one vectorized pass over each array): every suffix array entry a
    position of the shard, every token id in the vocabulary or the separator. Order is left to ``--verify``."""
    n = sa.shape[0]
    for start in range(0, n, _BOUNDS_CHUNK):
        part = sa[start : start + _BOUNDS_CHUNK]
        if part.size and (int(part.min()) < 0 or int(part.max()) >= n):
            return "the suffix array points outside its tokens"
        words = tokens[start : start + _BOUNDS_CHUNK]
        # the separator is the dtype's largest value, above the vocabulary: every id >= vocab_size must be it
        if np.count_nonzero(words >= vocab_size) != np.count_nonzero(words == separator):
            return f"a token id lies outside the vocabulary of {vocab_size}"
    return None
