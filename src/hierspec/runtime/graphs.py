"""Tree forwards replayed from CUDA graphs over a static KV cache.

On a GPU a small model's forward is hundreds of kernel launches, and launching them from Python costs more than
running them. A CUDA graph records the launches of one forward once and replays them with one call; it needs every
tensor the forward touches to stay at the same address with the same shape. So this path keeps:

* :class:`StaticTreeCache` — every layer's keys and values in one buffer ``[layers, 2, 1, kv_heads, capacity,
  head_dim]``, allocated once per loaded model and reused by every generation; a forward writes its rows at the
  slots named by a device tensor (``index_copy_``), and attention reads every slot, those past the context hidden
  by the mask;
* :class:`GraphedForward` — static ids, positions, slots and mask per row bucket, one graph per bucket captured
  lazily on first use, outputs read from the graph's static logits. Prefills (any length) run eagerly on the same
  cache.

Attention always spans the cache's whole capacity, whatever the context length: GPU attention kernels split and
reduce the keys by the length they are given, so a query attending a differently padded key range rounds
differently (measured on an H100 in bfloat16: drafting methods left plain decoding on 6 of 13 questions while the
width followed the context; BENCHMARKS.md). With one width, a token's logits do not depend on the step it is
verified in, at the cost of attending masked slots (about 0.1 ms per forward for SmolLM2 at 1,024 slots).

With ``capture=False`` (the CPU) the same static path runs eagerly, which is how the tests check it without a GPU.
Graph outputs are overwritten by the next replay: a caller consumes the logits before its next forward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hierspec.runtime.cuda_attention import PLAN_DTYPE, write_row_plan
from hierspec.runtime.kv_cache import cache_argument
from hierspec.tree import DraftTree, padded_ancestor_matrix

log = logging.getLogger(__name__)

#: slots of a new static cache at least (it grows, by doubling, for longer generations)
MIN_CAPACITY = 1024


@dataclass
class WritePlan:
    """Where the running forward writes its keys and values (``slots``, a device tensor) and how many slots its
    attention reads (``width``). Shared by every layer of a :class:`StaticTreeCache`."""

    slots: torch.Tensor | None = None
    width: int = MIN_CAPACITY


class StaticLayer(CacheLayerMixin):
    """One layer's keys and values: views into the cache's single buffer."""

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, plan: WritePlan, owner: StaticTreeCache) -> None:
        super().__init__()
        self._keys, self._values, self.plan, self.owner = keys, values, plan, owner
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers exist from the start (a graph must never see them move)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[1, kv_heads, rows, head_dim]`` at the planned slots; return the first ``width`` slots."""
        self._keys.index_copy_(2, self.plan.slots, key_states)
        self._values.index_copy_(2, self.plan.slots, value_states)
        return self._keys[:, :, : self.plan.width], self._values[:, :, : self.plan.width]

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.plan.width, 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def reset(self) -> None:
        self.owner.length = 0


class StaticTreeCache(Cache):
    """A KV cache of fixed capacity in one device buffer; ``length`` entries are committed.

    Unlike :class:`~hierspec.runtime.kv_cache.TreeCache` a forward does not extend ``length`` by itself (a replayed
    graph runs no Python): :class:`GraphedForward` advances it, and :meth:`keep` / :meth:`crop` shorten it.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.capacity = int(capacity)
        self.length = 0
        self.plan = WritePlan()
        self.buffer = torch.zeros((num_layers, 2, 1, kv_heads, self.capacity, head_dim), dtype=dtype, device=device)
        super().__init__(layers=[StaticLayer(self.buffer[i, 0], self.buffer[i, 1], self.plan, self)
                                 for i in range(num_layers)])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` entries (a negative value removes that many from the end)."""
        self.length = max(0, self.length + max_length if max_length < 0 else min(self.length, max_length))

    @contextlib.contextmanager
    def aligned(self, align: int) -> Iterator[None]:
        """Nothing to do: attention always spans the whole capacity on this cache."""
        yield

    def select_rows(self, rows: torch.Tensor) -> None:
        raise NotImplementedError("a static tree cache holds one sequence")

    @torch.inference_mode()
    def keep(self, start: int, kept: Sequence[int]) -> None:
        """Keep the entries ``start + kept[i]`` (ascending) as entries ``start ..``, every layer in one gather."""
        kept = list(kept)
        if kept != list(range(len(kept))):
            index = torch.as_tensor(kept, dtype=torch.long).add_(start).to(self.buffer.device, non_blocking=True)
            self.buffer[:, :, :, :, start : start + len(kept)] = self.buffer.index_select(4, index)
        self.length = start + len(kept)


@dataclass
class _Shape:
    """Static inputs and outputs of forwards of one ``(rows, width, hidden)`` shape, and their graph."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    staging: torch.Tensor  # host copy of ids, positions and slots: one transfer per step
    mask_staging: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    uses: int = field(default=0)


class GraphedForward:
    """Tree forwards of one model on a :class:`StaticTreeCache`, replayed from CUDA graphs when ``capture``.

    ``groups`` is the number of query heads per key/value head: the mask is written folded, as
    :func:`hierspec.runtime.attention.tree_attention` reads it. With ``exact``, tree forwards get a row plan instead
    of a mask (exact attention, :mod:`~hierspec.runtime.cuda_attention`). ``warmup`` eager forwards precede each
    capture (libraries choose kernels and allocate workspaces on first calls, which a graph must not record).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, groups: int, capture: bool,
                 warmup: int = 2, exact: bool = False) -> None:
        self.model, self.device, self.groups = model, device, max(1, groups)
        self.exact = exact
        self.capture = capture and device.type == "cuda"
        self.warmup = warmup
        self._shapes: dict[tuple[int, int, bool], _Shape] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = 0

    def forget(self) -> None:
        """Drop every captured graph (the cache they wrote to was replaced)."""
        self._shapes.clear()
        if self.capture:
            self._pool = torch.cuda.graph_pool_handle()

    @torch.inference_mode()
    def prefill(self, cache: StaticTreeCache, ids: Sequence[int], want_hidden: bool) -> torch.Tensor | None:
        """Eager forward of ``ids`` after the cache's entries (causal), committing them."""
        past, n, width = cache.length, len(ids), cache.capacity
        cache.plan.slots = torch.arange(past, past + n, device=self.device)
        cache.plan.width = width
        columns = torch.arange(width, device=self.device)
        mask = (columns[None, :] <= torch.arange(past, past + n, device=self.device)[:, None])[None, None]
        out = self.model(input_ids=torch.tensor([list(ids)], device=self.device), position_ids=cache.plan.slots[None],
                         attention_mask=mask, **cache_argument(self.model, cache), use_cache=True, logits_to_keep=1,
                         output_hidden_states=want_hidden)
        cache.length = past + n
        return out.hidden_states[-1][0, -1] if want_hidden else None

    @torch.inference_mode()
    def forward_tree(self, cache: StaticTreeCache, tree: DraftTree, rows: int, want_hidden: bool):
        """``(logits [n, vocab], hidden [n, h] | None)`` of ``tree`` over the cache, padded to ``rows`` rows; the
        cache then holds the ``rows`` new entries after its committed ones (:meth:`StaticTreeCache.keep` trims)."""
        past, n, width = cache.length, tree.size, cache.capacity
        shape = self._shape(rows, width, want_hidden)
        self._fill(shape, tree, past, rows, width)
        cache.plan.slots, cache.plan.width = shape.slots, width
        if past + rows > cache.capacity:
            raise ValueError(f"a forward of {rows} rows after {past} entries overflows the cache ({cache.capacity})")
        if shape.graph is not None:
            shape.graph.replay()
        elif self.capture and shape.uses >= self.warmup:
            self._capture(shape, cache, want_hidden)
        else:
            shape.logits, shape.hidden = self._run(shape, cache, want_hidden)
        shape.uses += 1
        cache.length = past + rows
        hidden = shape.hidden[:n] if want_hidden else None
        return shape.logits[:n], hidden

    # ----------------------------------------------------------------- internals
    def _shape(self, rows: int, width: int, want_hidden: bool) -> _Shape:
        key = (rows, width, want_hidden)
        if key not in self._shapes:
            pin = self.device.type == "cuda"
            # a row plan per row, or the folded boolean mask
            mask_shape, mask_dtype = ((rows, 2 + rows), PLAN_DTYPE) if self.exact else ((self.groups * rows, width),
                                                                                        torch.bool)
            self._shapes[key] = _Shape(
                ids=torch.zeros((1, rows), dtype=torch.long, device=self.device),
                positions=torch.zeros((1, rows), dtype=torch.long, device=self.device),
                slots=torch.zeros(rows, dtype=torch.long, device=self.device),
                mask=torch.zeros((1, 1, *mask_shape), dtype=mask_dtype, device=self.device),
                staging=torch.zeros((3, rows), dtype=torch.long, pin_memory=pin),
                mask_staging=torch.zeros(mask_shape, dtype=mask_dtype, pin_memory=pin),
            )
        return self._shapes[key]

    def _fill(self, shape: _Shape, tree: DraftTree, past: int, rows: int, width: int) -> None:
        """Write the tree's ids, positions, slots and mask into the shape's static inputs (two transfers).

        Padding rows repeat the root at the root's position and see the context and themselves only, so no real
        row depends on them (:mod:`hierspec.runtime.inputs`)."""
        n = tree.size
        staged = shape.staging.numpy()
        staged[0, :] = tree.tokens[0]
        staged[0, :n] = tree.tokens
        staged[1, :] = past
        staged[1, :n] += tree.depths
        staged[2, :] = np.arange(past, past + rows)
        block = padded_ancestor_matrix(tree, rows)
        if self.exact:
            write_row_plan(block, past, shape.mask_staging.numpy())
        else:
            mask = shape.mask_staging.numpy().reshape(self.groups, rows, width)
            mask[:, :, :past] = True
            mask[:, :, past : past + rows] = block
            mask[:, :, past + rows :] = False
        shape.ids.copy_(shape.staging[0:1], non_blocking=True)
        shape.positions.copy_(shape.staging[1:2], non_blocking=True)
        shape.slots.copy_(shape.staging[2], non_blocking=True)
        shape.mask[0, 0].copy_(shape.mask_staging, non_blocking=True)
        if self.device.type == "cuda":
            # the host staging buffers are rewritten by the next step: wait until these copies have read them
            torch.cuda.current_stream(self.device).synchronize()

    def _run(self, shape: _Shape, cache: StaticTreeCache, want_hidden: bool):
        out = self.model(input_ids=shape.ids, position_ids=shape.positions, attention_mask=shape.mask,
                         **cache_argument(self.model, cache), use_cache=True, output_hidden_states=want_hidden,
                         logits_to_keep=0)
        return out.logits[0], (out.hidden_states[-1][0] if want_hidden else None)

    def _capture(self, shape: _Shape, cache: StaticTreeCache, want_hidden: bool) -> None:
        """Record the shape's forward into a graph and replay it (the recording itself computes nothing)."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                shape.logits, shape.hidden = self._run(shape, cache, want_hidden)
        except RuntimeError as exc:  # an op that cannot be captured: keep running eagerly, say so once
            log.warning("CUDA graph capture failed, tree forwards run eagerly: %s", exc)
            self.capture = False
            shape.logits, shape.hidden = self._run(shape, cache, want_hidden)
            return
        shape.graph = graph
        self.captures += 1
        graph.replay()
