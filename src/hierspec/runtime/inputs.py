"""The inputs of one verification forward — token ids, position ids, tree mask — padded to a bucket size and written
into buffers allocated once.

A tree of ``n`` nodes verified in a bucket of ``rows >= n`` rows gets ``rows - n`` padding rows after the real ones:
each repeats the root's token at the root's position and sees only the context and itself, and no real node sees it,
so padding changes no real row's result; its cache entries are dropped with the rejected nodes.

Example — root ``r`` and drafts ``[a, b]``, ``[c]`` (4 nodes) over 3 cached tokens, in a bucket of 5 rows::

    ids        r  a  c  b  r         mask (columns: 3 cache slots, then the 5 rows)
    positions  3  4  4  5  3         r: 1 1 1  1 0 0 0 0
                                     a: 1 1 1  1 1 0 0 0
                                     c: 1 1 1  1 0 1 0 0
                                     b: 1 1 1  1 1 0 1 0
                                   pad: 1 1 1  0 0 0 0 1
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hierspec.runtime.exact_attention import ExactPlan
from hierspec.tree import DraftTree, padded_ancestor_matrix


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``size`` rows, or ``size`` itself past the largest bucket (or with none).

    Example: ``bucket_for(3, (2, 4, 8)) == 4``, ``bucket_for(1, (2, 4, 8)) == 2``, ``bucket_for(9, (2, 4, 8)) == 9``.
    """
    for bucket in buckets:
        if bucket >= size:
            return bucket
    return size


class TreeInputs:
    """Reusable buffers for the ids, positions and boolean attention mask of tree forwards on one device.

    With ``groups > 1`` (grouped-query attention) the mask is written folded, its rows repeated once per query head
    of a group (:func:`hierspec.runtime.attention.tree_attention`).
    """

    def __init__(self, device: torch.device, groups: int = 1, align: int = 1, rows: int = 64,
                 columns: int = 1024) -> None:
        self.device = device
        self.groups = max(1, groups)
        self.align = max(1, align)
        self._rows = 0
        self._columns = 0
        self._ensure(rows, columns)

    def fill(self, tree: DraftTree, past: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids [1, rows], position_ids [1, rows], mask [1, 1, groups * rows, width])`` for ``tree`` on top
        of ``past`` cached entries, padded to ``rows``; ``width`` is ``past + rows`` rounded up to the alignment, the
        columns past ``past + rows`` hidden."""
        width = -(-(past + rows) // self.align) * self.align
        ids, positions = self._write_rows(tree, past, rows, width)
        tiled = np.tile(padded_ancestor_matrix(tree, rows), (self.groups, 1))
        host = self._host is not None
        mask = (self._host[2] if host else self._mask)[: self.groups * rows, :width]
        mask[:, :past] = True
        mask[:, past : past + rows] = tiled if host else torch.from_numpy(tiled)
        mask[:, past + rows :] = False
        return ids, positions, self._mask[: self.groups * rows, :width][None, None]

    def fill_exact(self, tree: DraftTree, past: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, ExactPlan]:
        """:meth:`fill`'s ids and positions with, instead of the mask, the exact attention's plan of that mask
        (:meth:`ExactPlan.of_tree`): what the exact path reads, without the mask's ``rows x width`` writes."""
        ids, positions = self._write_rows(tree, past, rows, self._columns)
        return ids, positions, ExactPlan.of_tree(tree.parents, past, rows)

    def _write_rows(self, tree: DraftTree, past: int, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token and position in the buffers (grown to ``rows x columns`` where needed): the tree's nodes,
        then padding rows repeating the root."""
        n = tree.size
        if rows < n:
            raise ValueError(f"a bucket of {rows} rows cannot hold a tree of {n} nodes")
        self._ensure(rows, columns)
        # CPU buffers are written through their NumPy views (a torch operator costs 3-5 us of dispatch); on another
        # device ids and positions are made on the host and copied over
        host = self._host is not None
        ids = self._host[0][0, :rows] if host else np.empty(rows, dtype=np.int64)
        positions = self._host[1][0, :rows] if host else np.empty(rows, dtype=np.int64)
        ids[:] = tree.tokens[0]
        ids[:n] = tree.tokens
        positions[:] = past
        positions[:n] += tree.depths
        if not host:
            self._ids[0, :rows].copy_(torch.from_numpy(ids))
            self._positions[0, :rows].copy_(torch.from_numpy(positions))
        return self._ids[:, :rows], self._positions[:, :rows]

    def row_index(self, count: int) -> torch.Tensor:
        """``[0, 1, .., count - 1]`` on the device: the rows whose logits a forward keeps (the real nodes)."""
        self._ensure(count, self._columns)
        return self._arange[:count]

    def _ensure(self, rows: int, columns: int) -> None:
        if rows <= self._rows and columns <= self._columns:
            return
        self._rows = max(rows, self._rows)
        self._columns = max(columns, 2 * self._columns)
        self._ids = torch.zeros((1, self._rows), dtype=torch.long, device=self.device)
        self._positions = torch.zeros((1, self._rows), dtype=torch.long, device=self.device)
        self._mask = torch.zeros((self.groups * self._rows, self._columns), dtype=torch.bool, device=self.device)
        self._arange = torch.arange(self._rows, device=self.device)
        on_cpu = self.device.type == "cpu"
        #: NumPy views of the CPU buffers (the same memory), or None on another device
        self._host = (self._ids.numpy(), self._positions.numpy(), self._mask.numpy()) if on_cpu else None
