"""The successor table (Token Recycling's adjacency matrix, in Hierarchy Drafting's structure): for every token, the
target's top-k predictions the last time a verified tree node held that token.

Every verification forward computes the target's distribution after every tree node anyway; its top ``k`` tokens
are written into the row of the node's token, so the table keeps learning from rejected branches too. Drafts are
read as a small tree: the greedy chain of first successors from the root, and chains starting from the root's other
successors. The table outlives generations (and, inside a learning model store, processes).

Example: with successors ``5 → [6, 9]``, ``6 → [7, 2]``, ``7 → [5, 1]`` and ``9 → [1, ...]``, root 5, depth 3 and
width 2 give the chains ``[6, 7, 5]`` (rank 0) and ``[9, 1]`` (rank 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hierspec.datastore.format import open_array

UNKNOWN = -1


def stored_successors(directory: Path, header: dict) -> np.ndarray | None:
    """The successor table a model store's header names (memory-mapped; dtype, rank and file size checked), or
    ``None`` when it names none."""
    entry = header.get("arrays", {}).get("successors")
    return None if entry is None else open_array(directory, entry, ("<i4",), ndim=2)


class SuccessorTable:
    """``[vocab, k]`` int32 token ids, best first, ``-1`` where nothing is known yet."""

    def __init__(self, vocab_size: int, k: int = 8, table: np.ndarray | None = None) -> None:
        if table is not None and table.shape != (vocab_size, k):
            raise ValueError(f"a successor table of shape {table.shape} is not [{vocab_size}, {k}]")
        self.table = np.full((vocab_size, k), UNKNOWN, dtype=np.int32) if table is None else np.array(table,
                                                                                                  dtype=np.int32)
        self.updates = 0

    @property
    def k(self) -> int:
        return int(self.table.shape[1])

    def update(self, tokens: np.ndarray, topk: np.ndarray) -> None:
        """Record that after each of ``tokens`` the target ranked ``topk[i]`` (``[n, >= 1]``) first."""
        width = min(self.k, topk.shape[1])
        self.table[tokens, :width] = topk[:, :width]
        if width < self.k:
            self.table[tokens, width:] = UNKNOWN
        self.updates += int(tokens.shape[0])

    def chains(self, root: int, depth: int, width: int) -> list[tuple[list[int], int]]:
        """Up to ``width`` draft sequences with their rank: the chain of first successors starting from each of
        the root's ``width`` best successors, ``depth`` tokens at most."""
        out = []
        for rank, first in enumerate(self.table[root, :width].tolist()):
            if first == UNKNOWN:
                break
            chain = [first]
            while len(chain) < depth:
                following = int(self.table[chain[-1], 0])
                if following == UNKNOWN:
                    break
                chain.append(following)
            out.append((chain, rank))
        return out
