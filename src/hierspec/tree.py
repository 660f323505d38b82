"""Draft trees: several draft sequences merged into one trie and flattened for a single verification forward.

Node 0 is the *root*: the last committed token, whose key/value entries are not yet in the KV cache. Every other
node is a draft token. Nodes are stored breadth-first, so a parent always precedes its children, and shared prefixes
of the draft sequences appear once (REST section 3.2: "pseudo sequence" built by breadth-first search).

Example — root ``r`` and drafts ``[a, b]``, ``[a, c]``, ``[d]``::

    r ─ a ─ b          index:   0  1  2  3  4
      │   └ c          token:   r  a  d  b  c
      └ d              parent: -1  0  0  1  1
                       depth:   0  1  1  2  2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

ROOT_SOURCE = "root"


@dataclass(frozen=True)
class DraftTree:
    """A flattened, breadth-first draft tree.

    Attributes:
        tokens: token id of each node, shape ``[n]``; ``tokens[0]`` is the root.
        parents: index of each node's parent, shape ``[n]``; ``parents[0] == -1``.
        depths: distance from the root, shape ``[n]``.
        sources: name of the draft source that first proposed each node (``"root"`` for node 0).
        probs: optional draft probability of each node's token given its parent path, shape ``[n]``
            (``probs[0] == 1``); ``None`` for deterministic drafts.
        dists: for a *sampled* chain (a draft model's), the distribution each node's token was drawn from,
            ``[n, vocab]`` float64 (row 0 unused); verified by speculative sampling. ``None`` for deterministic drafts.
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    sources: tuple[str, ...]
    probs: np.ndarray | None = None
    dists: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Number of nodes, the root included."""
        return int(self.tokens.shape[0])

    @property
    def num_drafted(self) -> int:
        """Number of draft tokens (nodes below the root)."""
        return self.size - 1

    @property
    def is_chain(self) -> bool:
        """True when no node has two children (a single draft sequence)."""
        return bool(np.all(self.parents[1:] == np.arange(self.size - 1)))

    def children(self, node: int) -> dict[int, int]:
        """Map from token id to child index for the children of ``node``."""
        return self._child_maps()[node]

    def _child_maps(self) -> list[dict[int, int]]:
        maps = self.__dict__.get("_children")
        if maps is None:
            maps = [{} for _ in range(self.size)]
            for child in range(1, self.size):
                maps[int(self.parents[child])][int(self.tokens[child])] = child
            object.__setattr__(self, "_children", maps)
        return maps

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first draft token down to ``node`` (the root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def sequence(self, node: int) -> list[int]:
        """Draft tokens on the path from the root to ``node`` (the root's token excluded)."""
        return [int(self.tokens[i]) for i in self.path_to(node)]


def is_prefix(candidate: np.ndarray, kept: np.ndarray) -> bool:
    """True when the draft sequence ``candidate`` equals the start of ``kept`` (it would add no tree node)."""
    return candidate.shape[0] <= kept.shape[0] and bool(np.array_equal(candidate, kept[: candidate.shape[0]]))


def chain(root_token: int, tokens: Sequence[int], sources: Sequence[str], dists=None) -> DraftTree:
    """A single draft sequence as a tree; ``dists`` (``[len(tokens), vocab]``, optional) are the distributions the
    tokens were sampled from, stored as rows 1.. of :attr:`DraftTree.dists`."""
    n = len(tokens) + 1
    if dists is not None:
        dists = torch.cat([torch.zeros_like(dists[:1]), dists]) if len(tokens) else None
    return DraftTree(
        tokens=np.array([root_token, *tokens], dtype=np.int64),
        parents=np.arange(-1, n - 1, dtype=np.int64),
        depths=np.arange(n, dtype=np.int64),
        sources=(ROOT_SOURCE, *sources),
        dists=dists,
    )


def below_chain(tokens: Sequence[int], tree: DraftTree, source: str = "context") -> DraftTree:
    """``tree`` hung below a chain of ``tokens`` (its first token the new root, its last the old root's parent):
    node ``i`` of ``tree`` becomes node ``len(tokens) + i``, still breadth-first. Draft probabilities and
    distributions are dropped (the result is read for its logits, not verified)."""
    count = len(tokens)
    if count == 0:
        return tree
    parents = np.where(tree.parents >= 0, tree.parents + count, count - 1)
    return DraftTree(
        tokens=np.concatenate([np.asarray(tokens, dtype=np.int64), tree.tokens]),
        parents=np.concatenate([np.arange(-1, count - 1, dtype=np.int64), parents.astype(np.int64)]),
        depths=np.concatenate([np.arange(count, dtype=np.int64), tree.depths + count]),
        sources=(ROOT_SOURCE, *([source] * (count - 1)), source, *tree.sources[1:]),
    )


def root_only(root_token: int) -> DraftTree:
    """The empty draft: a tree holding only the root. Verifying it is one step of plain decoding."""
    return DraftTree(
        tokens=np.array([root_token], dtype=np.int64),
        parents=np.array([-1], dtype=np.int64),
        depths=np.array([0], dtype=np.int64),
        sources=(ROOT_SOURCE,),
    )


def build_tree(
    root_token: int,
    sequences: Sequence[Sequence[int]],
    sources: Sequence[str] | None = None,
    probs: Sequence[Sequence[float]] | None = None,
    budget: int | None = None,
) -> DraftTree:
    """Merge draft sequences into a trie and flatten it breadth-first.

    Sequences are taken in order of priority: when ``budget`` (the most draft nodes, root excluded) is reached, the
    remaining tokens are dropped, so earlier sequences keep their full length. A node shared by several sequences
    keeps the source and probability of the first sequence that reached it.

    Example: ``build_tree(7, [[1, 2], [1, 3], [4]])`` gives tokens ``[7, 1, 4, 2, 3]``, parents ``[-1, 0, 0, 1, 1]``.
    """
    if sources is not None and len(sources) != len(sequences):
        raise ValueError("sources must have one entry per sequence")
    if probs is not None and len(probs) != len(sequences):
        raise ValueError("probs must have one entry per sequence")
    limit = budget if budget is not None else sum(len(s) for s in sequences)

    # Insertion into a nested-dict trie: node id -> {token: child id}.
    trie_children: list[dict[int, int]] = [{}]
    trie_token = [int(root_token)]
    trie_source = [ROOT_SOURCE]
    trie_prob = [1.0]
    for seq_index, seq in enumerate(sequences):
        node = 0
        for pos, token in enumerate(seq):
            token = int(token)
            child = trie_children[node].get(token)
            if child is None:
                if len(trie_token) - 1 >= limit:
                    break
                child = len(trie_token)
                trie_children[node][token] = child
                trie_children.append({})
                trie_token.append(token)
                trie_source.append(sources[seq_index] if sources is not None else "draft")
                trie_prob.append(float(probs[seq_index][pos]) if probs is not None else 1.0)
            node = child
    return _flatten_breadth_first(trie_children, trie_token, trie_source, trie_prob if probs is not None else None)


def _flatten_breadth_first(
    children: list[dict[int, int]], tokens: list[int], sources: list[str], probs: list[float] | None
) -> DraftTree:
    order = [0]
    parent_of = {0: -1}
    depth_of = {0: 0}
    head = 0
    while head < len(order):
        node = order[head]
        head += 1
        for child in children[node].values():  # dicts keep insertion order: priority order among siblings
            parent_of[child] = node
            depth_of[child] = depth_of[node] + 1
            order.append(child)
    new_index = {old: new for new, old in enumerate(order)}
    return DraftTree(
        tokens=np.array([tokens[o] for o in order], dtype=np.int64),
        parents=np.array([new_index[parent_of[o]] if parent_of[o] >= 0 else -1 for o in order], dtype=np.int64),
        depths=np.array([depth_of[o] for o in order], dtype=np.int64),
        sources=tuple(sources[o] for o in order),
        probs=np.array([probs[o] for o in order], dtype=np.float64) if probs is not None else None,
    )


def ancestor_matrix(tree: DraftTree) -> np.ndarray:
    """Boolean ``[n, n]`` matrix: entry ``(i, j)`` is True when node ``j`` is node ``i`` or one of its ancestors."""
    n = tree.size
    anc = np.zeros((n, n), dtype=bool)
    for i in range(n):
        parent = int(tree.parents[i])
        if parent >= 0:
            anc[i] = anc[parent]
        anc[i, i] = True
    return anc


def padded_ancestor_matrix(tree: DraftTree, rows: int) -> np.ndarray:
    """Boolean ``[rows, rows]``: :func:`ancestor_matrix` in the top-left corner of a forward padded to ``rows``
    rows, each padding row seeing itself only."""
    block = np.eye(rows, dtype=bool)
    block[: tree.size, : tree.size] = ancestor_matrix(tree)
    return block


def tree_attention_mask(tree: DraftTree, context_length: int) -> np.ndarray:
    """Boolean ``[n, context_length + n]`` mask, True where a node may attend.

    Each node sees the whole committed context (the KV cache, ``context_length`` entries) plus its ancestors and
    itself — never a sibling branch.
    """
    n = tree.size
    mask = np.ones((n, context_length + n), dtype=bool)
    mask[:, context_length:] = ancestor_matrix(tree)
    return mask


def tree_position_ids(tree: DraftTree, context_length: int) -> np.ndarray:
    """Position id of each node: the context length plus its depth (the root sits right after the cache)."""
    return context_length + tree.depths
