"""REST: retrieval-based drafts from a suffix-array datastore (He et al., 2024, algorithms 1 and 2).

Each step: find the longest suffix of the context present in the store (``n_max`` tokens down to ``n_min``), take up
to ``k`` of its occurrences, read the ``m`` tokens after each, count every continuation prefix in a trie, and keep
the ``c`` most frequent trie nodes as the draft tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hierspec.datastore.suffix import SuffixStore
from hierspec.drafters.base import Drafter
from hierspec.drafters.registry import register
from hierspec.errors import InputError
from hierspec.tree import DraftTree, build_tree, root_only


#: rest's ``corpus`` option: the directory of that default store under the model's store root
DEFAULT_STORES = {"chat": "suffix", "code": "code"}


@dataclass(frozen=True)
class RestConfig:
    """REST retrieval settings (the paper's defaults).

    Attributes:
        n_max: longest context suffix looked up.
        n_min: shortest suffix tried before giving up (no draft this step).
        k: most occurrences read.
        m: continuation length.
        c: most draft-tree nodes kept (further capped by the step's budget).
        min_share: drop trie nodes that fewer than this share of the retrieved continuations start with; when no node
            is left the step drafts nothing (a plain one-token forward). 0 keeps the paper's behaviour. On a CPU,
            where verifying any draft costs ~1.5x a plain step, low-confidence drafts cost more than they save.
        corpus: which of the model's default stores (``hierspec datastore build --preset default``) to read when no
            suffix store is given with ``--datastore``: ``chat`` (ShareGPT answers) or ``code`` (Python sources).
    """

    n_max: int = 16
    n_min: int = 2
    k: int = 5000
    m: int = 10
    c: int = 64
    min_share: float = 0.0
    corpus: str = "chat"

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise InputError("rest needs 1 <= n_min <= n_max")
        if min(self.k, self.m, self.c) < 1:
            raise InputError("rest needs k, m and c >= 1")
        if not 0.0 <= self.min_share <= 1.0:
            raise InputError("rest needs 0 <= min_share <= 1")
        if self.corpus not in DEFAULT_STORES:
            raise InputError(f"rest corpus={self.corpus!r}: use {' or '.join(DEFAULT_STORES)}")


def top_trie_nodes(rows: np.ndarray, c: int, min_count: int = 0) -> list[np.ndarray]:
    """The ``c`` most frequent prefixes of continuation rows, as token sequences in rank order.

    Prefixes that fewer than ``min_count`` rows start with are never selected.

    ``rows`` is ``[r, m]`` int64 padded with ``-1``. A prefix's count is the number of rows starting with it. Ranking
    is by count (descending), then depth (shallower first), then the prefix's lexicographic order — so a node never
    ranks below its descendants (a parent's count is at least its child's) and the kept set is a connected subtree
    of the trie containing the root's children it needs. Every returned sequence extends an earlier one by one
    token, or is a depth-1 node.

    Example: rows ``[[1, 2], [1, 2], [1, 3], [4, -1]]`` with ``c = 3`` give ``[[1], [1, 2], [4]]``
    (counts 3, 2 and 1; ``[1, 3]`` ties with ``[4]`` at count 1 but is deeper).
    """
    if rows.shape[0] == 0 or c <= 0:
        return []
    rows = rows[lexicographic_order(rows)]
    r, m = rows.shape
    differs = rows[1:] != rows[:-1]
    # lcp[i]: first column where row i differs from row i - 1 (m when equal); row 0 starts every prefix.
    lcp = np.concatenate([[0], np.where(differs.any(axis=1), differs.argmax(axis=1), m)])
    starts = lcp[:, None] <= np.arange(m)[None, :]  # row i opens a new prefix of length d + 1
    opened = np.where(starts, np.arange(r)[:, None], r)
    # next_open[i, d]: first row after i that opens another prefix of length d + 1 (r if none)
    next_open = np.vstack([np.minimum.accumulate(opened[::-1], axis=0)[::-1][1:], np.full((1, m), r)])
    node_row, node_depth = np.nonzero(starts & (rows >= 0))
    count = next_open[node_row, node_depth] - node_row
    if min_count > 0:
        frequent = count >= min_count
        node_row, node_depth, count = node_row[frequent], node_depth[frequent], count[frequent]
        if count.shape[0] == 0:
            return []
    # rank: count desc, then depth asc, then lexicographic position asc — one int64 key, only the top c sorted
    key = (r - count) * (m * r) + node_depth * r + node_row
    top = np.argpartition(key, c - 1)[:c] if c < key.shape[0] else np.arange(key.shape[0])
    ranked = top[np.argsort(key[top])]
    return [rows[node_row[i], : node_depth[i] + 1] for i in ranked]


def lexicographic_order(rows: np.ndarray) -> np.ndarray:
    """Row order sorting ``rows`` lexicographically (``-1`` padding first), several tokens packed per sort key.

    Packing 4 (or 2, for ids >= 65535) tokens into one uint64 key makes the sort 2–5x cheaper than one key per
    column; the order is the same.
    """
    shifted = (rows + 1).astype(np.uint64)
    bits = 16 if int(shifted.max(initial=0)) < (1 << 16) else 32
    per_key = 64 // bits
    keys = []
    for first in range(0, rows.shape[1], per_key):
        block = shifted[:, first : first + per_key]
        key = np.zeros(rows.shape[0], dtype=np.uint64)
        for j in range(per_key):
            key <<= np.uint64(bits)
            if j < block.shape[1]:
                key |= block[:, j]
        keys.append(key)
    return np.lexsort(keys[::-1])  # lexsort's last key is the primary one


class RestDrafter(Drafter):
    """Drafts the most frequent continuations of the context's longest suffix found in a suffix-array store."""

    name = "rest"

    def __init__(self, store: SuffixStore, config: RestConfig | None = None) -> None:
        self.store = store
        self.config = config or RestConfig()

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        root = int(context[-1])
        limit = min(self.config.c, budget)
        if limit <= 0:
            return root_only(root)
        match = self.store.longest_match(context, self.config.n_max, self.config.n_min)
        if match is None:
            return root_only(root)
        rows = self.store.continuations(match, self.config.k, self.config.m)
        min_count = int(np.ceil(self.config.min_share * rows.shape[0]))
        sequences = top_trie_nodes(rows, limit, min_count)
        return build_tree(root, sequences, sources=[self.name] * len(sequences), budget=limit)


@register("rest", RestConfig, summary="REST: retrieval from a suffix-array datastore (--datastore, else the "
                                     "model's default store)")
def build_rest(options: RestConfig, written: dict[str, str], context) -> RestDrafter:
    """``rest:n_max=16,n_min=2,k=5000,m=10,c=64,min_share=0,corpus=chat`` over the given suffix store, else the
    default store ``corpus`` names."""
    fingerprint, name = context.fingerprint()
    path = context.optional_datastore("suffix", DEFAULT_STORES[options.corpus])
    if path is None:
        raise InputError(f"method 'rest' needs a 'suffix' datastore: pass --datastore DIR (build one with "
                         f"`hierspec datastore build --kind suffix`), or build this model's default stores, "
                         f"{DEFAULT_STORES[options.corpus]}/ among them (`make stores MODEL=...`, that is "
                         f"`hierspec datastore build --preset default --model ...`)")
    store = context.shared(("suffix", path), lambda: SuffixStore.open(path, fingerprint=fingerprint,
                                                                     tokenizer_name=name))
    return RestDrafter(store, options)
