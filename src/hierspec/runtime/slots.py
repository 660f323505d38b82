"""KV caches that share one buffer per layer, so a batched forward attends to all its sequences in one call.

A batch of sequences each on its own :class:`~hierspec.runtime.kv_cache.TreeCache` costs one attention call, one
key write and one value write per sequence per layer (240 of each for 8 sequences of a 30-layer model: ~20 % of
an 8-sequence step in Python and small copies, BENCHMARKS.md). A :class:`SlotPool` holds every layer's keys and
values for ``slots`` sequences in one ``[slots, kv_heads, capacity, head_dim]`` buffer; each :class:`SlotCache` is
an ordinary ``TreeCache`` whose layers are views of one slot, so prefill, single-sequence forwards and the accepted
path's compaction work on it unchanged. :func:`slot_attention` then verifies all the batch's rows at once: their
keys written with one indexed copy per layer, their queries gathered into ``[slots, kv_heads, rows, head_dim]`` and
one SDPA call per layer.

Each sequence's result is bit-equal to its own forward because CPU SDPA computes every ``(slot, head, query
block)`` independently, every query block holds a multiple of 4 folded rows (as
:func:`~hierspec.runtime.attention.tree_attention` pads them), and the key blocks past a sequence's own aligned
width are wholly masked (exact zeros). ``tests/test_slots.py`` fails if a PyTorch release changes that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hierspec.runtime.attention import QUERY_ROW_MULTIPLE, additive_mask
from hierspec.runtime.kv_cache import GrowableLayer, TreeCache, doubled_capacity, regrown


class SlotLayer(GrowableLayer):
    """One layer of one slot: a :class:`GrowableLayer` whose buffers are views of the pool's."""

    def __init__(self, pool: SlotPool, index: int, slot: int) -> None:
        super().__init__(pool.capacity, pool.storage_dtype)
        self.pool, self.index, self.slot = pool, index, slot

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.pool.allocate(key_states)

    def bind(self) -> None:
        """Point this layer's buffers at the pool's current ones (after allocation or growth)."""
        keys, values = self.pool.keys[self.index], self.pool.values[self.index]
        self._keys, self._values = keys[self.slot : self.slot + 1], values[self.slot : self.slot + 1]
        self.capacity = self.pool.capacity
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        self.pool.grow(needed)

    def select_rows(self, rows: torch.Tensor) -> None:
        raise NotImplementedError("a slot cache holds one sequence")

    def set_length(self, length: int) -> None:
        """Entries ``0 .. length - 1`` are held (a batched forward wrote them into the pool)."""
        self.length = length


class SlotCache(TreeCache):
    """The KV cache of one slot of a :class:`SlotPool`."""

    def __init__(self, pool: SlotPool, slot: int) -> None:
        super(TreeCache, self).__init__(layers=[SlotLayer(pool, index, slot) for index in range(pool.num_layers)])
        self.pool, self.slot = pool, slot


class SlotPool:
    """Keys and values of ``slots`` sequences, one buffer per layer; buffers appear at the first write (with that
    write's device and shape, and ``storage_dtype`` or else that write's dtype) and double in length, for every slot
    at once, when one slot needs more room."""

    def __init__(self, num_layers: int, slots: int, capacity: int, storage_dtype: torch.dtype | None = None) -> None:
        self.num_layers, self.slots, self.capacity = num_layers, slots, capacity
        self.storage_dtype = storage_dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.caches = [SlotCache(self, slot) for slot in range(slots)]

    def allocate(self, like: torch.Tensor) -> None:
        """Zeroed buffers shaped after ``like`` (``[1, kv_heads, n, head_dim]``): slots past a sequence's entries
        stay finite, as aligned attention needs."""
        shape = (self.slots, like.shape[1], self.capacity, like.shape[-1])
        dtype = self.storage_dtype or like.dtype
        self.keys = [like.new_zeros(shape, dtype=dtype) for _ in range(self.num_layers)]
        self.values = [like.new_zeros(shape, dtype=dtype) for _ in range(self.num_layers)]
        self._bind()

    def grow(self, needed: int) -> None:
        """Room for ``needed`` entries in every slot (held entries copied)."""
        if needed <= self.capacity:
            return
        capacity = doubled_capacity(self.capacity, needed)
        for buffers in (self.keys, self.values):
            buffers[:] = [regrown(old, capacity, self.capacity) for old in buffers]
        self.capacity = capacity
        self._bind()

    def _bind(self) -> None:
        for cache in self.caches:
            for layer in cache.layers:
                layer.bind()


@dataclass(frozen=True)
class SlotBatch:
    """Where each row of a batched forward goes in the pool, and the attention's inputs, made once per forward.

    Attributes:
        pool: the pool every sequence's cache belongs to; ``first``: the lowest slot attended (slots ``first ..
            first + count - 1`` are attended, those without rows through one finite dummy row each).
        slot_index, position_index: ``[rows]``: each row's slot and cache position (its keys' destination).
        gather: ``[count * per_slot]``: the row each slot's query row ``i`` reads (dummy rows read row 0).
        scatter: ``[rows]``: each row's place among the ``count * per_slot`` attended rows.
        per_slot: query rows per slot (before folding the grouped heads); ``mask``: additive ``[count, 1, folded,
            width]``, ``folded`` being ``groups * per_slot`` rounded up to a multiple of 4 (dummy rows at the end).
        ends: each sequence's cache and the entries it holds once the forward has written its rows.
    """

    pool: SlotPool
    first: int
    count: int
    slot_index: torch.Tensor
    position_index: torch.Tensor
    gather: torch.Tensor
    scatter: torch.Tensor
    per_slot: int
    mask: torch.Tensor
    ends: tuple[tuple[SlotCache, int], ...]

    @property
    def width(self) -> int:
        return self.mask.shape[-1]


def plan_slot_batch(caches: Sequence[SlotCache], bounds: Sequence[tuple[int, int]], masks: Sequence[torch.Tensor],
                    groups: int, dtype: torch.dtype) -> SlotBatch:
    """The :class:`SlotBatch` of sequences ``caches`` whose rows are ``bounds[i] = (start, stop)`` of the forward
    and whose boolean masks (``[1, 1, rows or groups * rows, width_i]``, each width a whole number of key blocks)
    are ``masks``."""
    pool = caches[0].pool
    device = masks[0].device
    slots = [cache.slot for cache in caches]
    first = min(slots)
    count = max(slots) - first + 1
    per_slot = max(stop - start for start, stop in bounds)
    # folded rows per slot padded at the end to a multiple of QUERY_ROW_MULTIPLE, as tree_attention pads one sequence's
    folded = -(-groups * per_slot // QUERY_ROW_MULTIPLE) * QUERY_ROW_MULTIPLE
    width = max(mask.shape[-1] for mask in masks)
    rows = bounds[-1][1]
    pool.grow(width)  # every mask's width covers its sequence's cache and rows: the writes need no more
    writes = plan_slot_writes(caches, bounds)
    additive = torch.full((count, 1, folded, width), -torch.inf, dtype=dtype, device=device)
    additive[..., 0] = 0.0  # dummy rows attend the first key: finite, never read
    gather = torch.zeros(count * per_slot, dtype=torch.long)
    scatter = torch.empty(rows, dtype=torch.long)
    for cache, (start, stop), mask in zip(caches, bounds, masks):
        local, n = cache.slot - first, stop - start
        gather[local * per_slot : local * per_slot + n] = torch.arange(start, stop)
        scatter[start:stop] = torch.arange(local * per_slot, local * per_slot + n)
        own = additive_mask(mask[0, 0, :n], dtype)
        block = additive[local, 0, : groups * per_slot].view(groups, per_slot, width)
        block[:, :n, : mask.shape[-1]] = own
        block[:, :n, mask.shape[-1] :] = -torch.inf
    return SlotBatch(pool, first, count, writes.slot_index.to(device), writes.position_index.to(device),
                     gather.to(device), scatter.to(device), per_slot, additive, writes.ends)


@dataclass(frozen=True)
class SlotWrites:
    """Where each row of a batched forward writes its keys and values in the pool (as :class:`SlotBatch` says it,
    for attention that reads the pool itself: :func:`~hierspec.runtime.exact_attention.exact_attention_blocks`)."""

    pool: SlotPool
    slot_index: torch.Tensor
    position_index: torch.Tensor
    ends: tuple[tuple[SlotCache, int], ...]


def plan_slot_writes(caches: Sequence[SlotCache], bounds: Sequence[tuple[int, int]]) -> SlotWrites:
    """The :class:`SlotWrites` of sequences ``caches`` whose rows are ``bounds[i] = (start, stop)`` of the forward;
    the pool grows to hold them."""
    pool = caches[0].pool
    rows = bounds[-1][1]
    slot_index = torch.empty(rows, dtype=torch.long)
    position_index = torch.empty(rows, dtype=torch.long)
    ends = []
    for cache, (start, stop) in zip(caches, bounds):
        past = cache.get_seq_length()
        slot_index[start:stop] = cache.slot
        position_index[start:stop] = torch.arange(past, past + stop - start)
        ends.append((cache, past + stop - start))
    pool.grow(max(end for _, end in ends))
    return SlotWrites(pool, slot_index, position_index, tuple(ends))


def write_slot_rows(writes: SlotWrites | SlotBatch, index: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Layer ``index``'s keys and values ``[1, kv_heads, rows, d]`` into the pool, one indexed copy each."""
    keys, values = writes.pool.keys[index], writes.pool.values[index]
    # keys[slot_r, :, position_r] = key[0, :, r] for every row r
    keys[writes.slot_index, :, writes.position_index] = key[0].transpose(0, 1)
    values[writes.slot_index, :, writes.position_index] = value[0].transpose(0, 1)


def slot_attention(batch: SlotBatch, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """Layer ``index``'s attention for every row of the batch: ``query [1, heads, rows, d]``, ``key``/``value``
    ``[1, kv_heads, rows, d]`` (written into the pool here) → ``[rows, heads * d]``."""
    pool = batch.pool
    keys, values = pool.keys[index], pool.values[index]
    write_slot_rows(batch, index, key, value)
    heads, rows, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    count, per_slot = batch.count, batch.per_slot
    gathered = query[0].view(kv_heads, groups, rows, dim).index_select(2, batch.gather)
    folded = gathered.view(kv_heads, groups, count, per_slot, dim).permute(2, 0, 1, 3, 4)
    folded = folded.reshape(count, kv_heads, groups * per_slot, dim)
    extra = batch.mask.shape[2] - groups * per_slot
    if extra:
        folded = torch.cat((folded, folded.new_zeros(count, kv_heads, extra, dim)), dim=2)
    span = slice(batch.first, batch.first + count)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, keys[span, :, : batch.width], values[span, :, : batch.width], attn_mask=batch.mask, scale=scaling)
    out = out[:, :, : groups * per_slot].reshape(count, kv_heads, groups, per_slot, dim)
    out = out.permute(0, 3, 1, 2, 4).reshape(count * per_slot, -1)
    return out.index_select(0, batch.scatter)


def finish_slot_batch(batch: SlotBatch | SlotWrites) -> None:
    """Every sequence's layers hold the rows the forward wrote."""
    for cache, end in batch.ends:
        for layer in cache.layers:
            layer.set_length(end)
