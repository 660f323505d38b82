"""A KV cache in preallocated buffers, compacted in place after each verification.

transformers' ``DynamicCache`` concatenates every new key and value onto the whole cache (a full copy per layer per
step), and dropping rejected tree nodes then costs a gather, a crop and a re-append. :class:`TreeCache` keeps each
layer's keys and values in one buffer ``[batch, kv_heads, capacity, head_dim]`` that doubles when full: a forward
writes its entries after the committed ones and attends to a view, and :meth:`TreeCache.keep` moves the accepted
path's entries to their final slots (a copy of at most a few rows). It is a ``transformers.Cache`` of
``CacheLayerMixin`` layers, so an unmodified model uses it through the public cache API.

Inside :meth:`TreeCache.aligned`, a layer hands attention a view whose length is rounded up to a multiple of the
alignment: the slots past the held entries are finite (buffers start zeroed) and the caller's mask hides them. CPU
attention reduces keys in blocks and splits the last, partial block's products by its width, so without alignment a
token's attention output would depend on how many tree nodes were verified beside it; aligned to whole blocks
(:data:`hierspec.runtime.attention.KEY_BLOCK`), masked slots add exact zeros and it does not.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hierspec.errors import InputError
from hierspec.runtime.int4_kernel import loaded_kernel

#: slots a layer's buffer starts with when no size is given
DEFAULT_CAPACITY = 256


def cache_argument(model: torch.nn.Module, cache) -> Mapping[str, object]:
    """``cache`` as the keyword argument ``model``'s forward takes it: ``cache=`` where its signature names one
    (transformers' recent releases: ``past_key_values`` is deprecated there and leaves in 5.40), else
    ``past_key_values=``. Every call that hands a model its KV cache goes through here."""
    return {_cache_keyword(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class GrowableLayer(CacheLayerMixin):
    """One layer's keys and values: ``length`` committed-or-pending entries in a buffer of ``capacity`` slots."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, capacity: int = DEFAULT_CAPACITY, storage_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.storage_dtype = storage_dtype
        self.length = 0
        self.align = 1
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._whole: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # buffers() and its _keys

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        dtype = self.storage_dtype or key_states.dtype
        self._keys = key_states.new_zeros((batch, heads, self.capacity, key_states.shape[-1]), dtype=dtype)
        self._values = value_states.new_zeros((batch, heads, self.capacity, value_states.shape[-1]), dtype=dtype)
        self.dtype, self.device = dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[batch, kv_heads, n, head_dim]`` entries; return views of every entry held (and, when aligned,
        of the slots up to the next multiple of the alignment), in the storage dtype."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        visible = -(-end // self.align) * self.align
        if visible > self.capacity:
            self._grow(visible)
        if self.storage_dtype is not None and self.storage_dtype != key_states.dtype:
            _check_narrowable(self.storage_dtype, key_states, value_states)
        self._keys[:, :, self.length : end].copy_(key_states)
        self._values[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self._keys[:, :, :visible], self._values[:, :, :visible]

    def reserve(self, count: int, like: torch.Tensor) -> int:
        """Make room for ``count`` entries after the held ones and count them as held (a caller writes them into
        :meth:`buffers`); return the first one's slot. ``like``: ``[1, kv_heads, any, head_dim]`` of the entries'
        dtype, for a layer's first allocation."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        start = self.length
        if start + count > self.capacity:
            self._grow(start + count)
        self.length = start + count
        return start

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys' and values' whole buffers of a one-sequence layer, ``[kv_heads, capacity, head_dim]`` each (the
        views made once per allocation: every tree forward asks for all layers')."""
        whole = self._whole
        if whole is None or whole[2] is not self._keys:
            if self._keys.shape[0] != 1:
                raise ValueError("buffers() is for a cache of one sequence")
            whole = self._whole = (self._keys[0], self._values[0], self._keys)
        return whole[0], whole[1]

    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """Keep entries ``start + offsets`` (ascending, ``offsets[i] >= i``) as entries ``start .. start + len - 1``
        and drop everything after them."""
        if not self.is_initialized:
            return
        count = int(offsets.shape[0])
        index = offsets.to(self._keys.device) + start
        # advanced indexing reads every source before the slice is written
        self._keys[:, :, start : start + count] = self._keys.index_select(2, index)
        self._values[:, :, start : start + count] = self._values.index_select(2, index)
        self.length = start + count

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (batched generation drops finished sequences)."""
        if self.is_initialized:
            self._keys = self._keys.index_select(0, rows.to(self._keys.device))
            self._values = self._values.index_select(0, rows.to(self._values.device))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` entries (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of entries to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def _grow(self, needed: int) -> None:
        capacity = doubled_capacity(self.capacity, needed)
        self._keys = regrown(self._keys, capacity, self.length)
        self._values = regrown(self._values, capacity, self.length)
        self.capacity = capacity

    # ``keys`` / ``values``: views of the held entries, as other cache layers expose them; derived on access (a
    # batched step changes 240 layers' lengths, and making two views each time cost ~4 ms of a 135 ms step)
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self.length]

    @keys.setter
    def keys(self, value: None) -> None:
        _derived_only(value)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, : self.length]

    @values.setter
    def values(self, value: None) -> None:
        _derived_only(value)


def _check_narrowable(dtype: torch.dtype, *entries: torch.Tensor) -> None:
    """Entries are finite and within ``dtype``'s range (a float16 cache holds |x| <= 65504), checked before they are
    stored, so a refused write leaves the cache as it was (one ``aminmax`` per tensor: a fifth of the time of
    checking the narrowed entries with ``isfinite``, ~3 ms of a SmolLM2 prompt)."""
    bound = torch.finfo(dtype).max
    for entry in entries:
        low, high = torch.aminmax(entry)
        if not (low >= -bound and high <= bound):  # NaN compares false
            raise InputError(f"a key or value beyond {dtype}'s range for the KV cache: load the model with "
                             "--kv-cache model")


def doubled_capacity(capacity: int, needed: int) -> int:
    """``capacity`` doubled until it holds ``needed`` entries."""
    while capacity < needed:
        capacity *= 2
    return capacity


def regrown(buffer: torch.Tensor, capacity: int, held: int) -> torch.Tensor:
    """A zeroed ``[batch, heads, capacity, dim]`` buffer holding the first ``held`` entries of ``buffer``."""
    grown = buffer.new_zeros((*buffer.shape[:2], capacity, buffer.shape[-1]))
    grown[:, :, :held] = buffer[:, :, :held]
    return grown


def _derived_only(value: object) -> None:
    """transformers' layer base class sets ``keys``/``values`` to None at construction; nothing else may set them."""
    if value is not None:
        raise AttributeError("a GrowableLayer's keys and values are views of its buffers; write through update()")


class TreeCache(Cache):
    """A KV cache of :class:`GrowableLayer` layers, one per decoder layer; entries stored in ``storage_dtype``
    (``None``: the dtype of the first entries written)."""

    def __init__(self, num_layers: int, capacity: int = DEFAULT_CAPACITY,
                 storage_dtype: torch.dtype | None = None) -> None:
        super().__init__(layers=[GrowableLayer(capacity, storage_dtype) for _ in range(num_layers)])

    @contextlib.contextmanager
    def aligned(self, align: int) -> Iterator[None]:
        """Within the block, attention sees key/value views rounded up to a multiple of ``align`` slots; the
        forward's mask must be that wide and hide the slots past the entries."""
        for layer in self.layers:
            layer.align = align
        try:
            yield
        finally:
            for layer in self.layers:
                layer.align = 1

    def reserve(self, count: int, like: torch.Tensor) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """:meth:`GrowableLayer.reserve` on every layer: the first new entry's slot and each layer's
        :meth:`GrowableLayer.buffers` (taken after every layer has grown: a slot pool grows all of them at once)."""
        starts = {layer.reserve(count, like) for layer in self.layers}
        if len(starts) != 1:
            raise ValueError("the cache's layers hold different numbers of entries")
        return starts.pop(), [layer.buffers() for layer in self.layers]

    @torch.inference_mode()
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` of every layer."""
        for layer in self.layers:
            layer.select_rows(rows)

    @torch.inference_mode()
    def keep(self, start: int, kept: Sequence[int]) -> None:
        """Keep the entries ``start + kept[i]`` (ascending tree node indices, root first) as the new tail and drop the
        rest of the last forward's entries. ``kept == [0, 1, .., k-1]`` only shortens the cache."""
        kept = list(kept)
        if kept == list(range(len(kept))):
            for layer in self.layers:
                layer.crop(start + len(kept) - layer.get_seq_length())
            return
        offsets = torch.as_tensor(kept, dtype=torch.long)
        layers = [layer for layer in self.layers if layer.is_initialized]
        buffers = [buffer for layer in layers for buffer in (layer._keys, layer._values)]
        compiled = loaded_kernel()
        if compiled is not None and all(b.device.type == "cpu" and b.is_contiguous() for b in buffers):
            compiled.keep_entries(buffers, start, offsets)  # one call for every layer (cache_keep.cpp)
            for layer in layers:
                layer.length = start + offsets.shape[0]
            return
        for layer in self.layers:
            layer.keep(start, offsets)
