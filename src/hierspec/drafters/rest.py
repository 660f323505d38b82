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
from hierspec.errors import InputError
from hierspec.tree import DraftTree, build_tree, root_only


@dataclass(frozen=True)
class RestConfig:
    """REST retrieval settings (the paper's defaults).

    Attributes:
        n_max: longest context suffix looked up.
        n_min: shortest suffix tried before giving up (no draft this step).
        k: most occurrences read.
        m: continuation length.
        c: most draft-tree nodes kept (further capped by the step's budget).
    """

    n_max: int = 16
    n_min: int = 2
    k: int = 5000
    m: int = 10
    c: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise InputError("rest needs 1 <= n_min <= n_max")
        if min(self.k, self.m, self.c) < 1:
            raise InputError("rest needs k, m and c >= 1")


def top_trie_nodes(rows: np.ndarray, c: int) -> list[np.ndarray]:
    """The ``c`` most frequent prefixes of continuation rows, as token sequences in rank order.

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
    order = np.lexsort(rows.T[::-1])  # lexsort's last key is the primary one
    rows = rows[order]
    r, m = rows.shape
    differs = rows[1:] != rows[:-1]
    # lcp[i]: first column where row i differs from row i - 1 (m when equal); row 0 starts every prefix.
    lcp = np.concatenate([[0], np.where(differs.any(axis=1), differs.argmax(axis=1), m)])
    depths, starts, counts = [], [], []
    for d in range(m):
        node_starts = np.flatnonzero(lcp <= d)
        node_counts = np.diff(np.append(node_starts, r))
        valid = rows[node_starts, d] >= 0
        depths.append(np.full(int(valid.sum()), d))
        starts.append(node_starts[valid])
        counts.append(node_counts[valid])
    depth = np.concatenate(depths)
    start = np.concatenate(starts)
    count = np.concatenate(counts)
    # rank: count desc, then depth asc, then lexicographic position (start row) asc
    ranked = np.lexsort((start, depth, -count))[:c]
    return [rows[start[i], : depth[i] + 1] for i in ranked]


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
        sequences = top_trie_nodes(rows, limit)
        return build_tree(root, sequences, sources=[self.name] * len(sequences), budget=limit)
