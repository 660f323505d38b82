"""Tree attention whose every row is bit-identical to the same token verified in plain decoding (``--attention
exact``).

CPU attention kernels (PyTorch's flash attention, BLAS products) sum over keys in blocks and vector lanes laid out
by the *slots* the keys sit in and by how many rows share the call (``scripts/attention_slots.py``): a node of a
second branch sees its ancestors at breadth-first slots, not where plain decoding puts its tokens, so its logits may
differ in the last bits and a near-tie may flip (BENCHMARKS.md, "Exact tree attention"). Here a row's arithmetic
depends on its query and its *logical* key sequence only: :func:`attend_rows` (compiled with numba) walks each
row's attended slots in ascending order — for a tree laid out breadth-first that is the order of its path, the
cached context first — and computes the scores, a two-pass softmax and the weighted sum of values one row and one
key/value head at a time, every reduction in an order fixed by that sequence alone. So a token gives the same bits
alone, in a chain or at any depth of any tree, among any number of rows (``tests/test_exact_attention.py``).

One compiled call per layer replaces the dozen small PyTorch operations of the flash-attention split it succeeds,
and only attended keys are read (SmolLM2-135M, 1 row over 200 cached tokens, one thread: ~22 µs per layer against
~120 µs for that split). Its work grows with rows x keys on one thread, so a call of many rows costs more than
PyTorch's attention (below: 1.9x at 16 rows over 200 keys; faster at 1–2 rows). Low-precision
caches (bfloat16, float16) are attended in float32, as PyTorch's CPU attention accumulates them, and rounded back.
Eleventh session (Zen 4, one layer call over 200 cached keys, SmolLM2's 9/3 heads): float32 exponentials as
vectorisable Cephes ``expf`` (within ~1.3 ulp; libm's scalar calls were ~40 % of the kernel), dot products started
from a typed zero (a start read from an array kept them scalar), keys scored and values summed four at a time —
1/4/16/32 rows 58/150/527/1052 -> 41/85/241/464 µs; a SmolLM2 int4 forward of 16 tree tokens ~60 -> ~52 ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import njit

#: cache dtypes the kernel reads directly; others are attended in float32 (their values converted exactly)
NATIVE_DTYPES = (torch.float32, torch.float64)


class ExactPlan:
    """Each row's attended slots, made once per forward from its boolean mask ``[rows, width]`` (True = attend) and
    shared by every layer.

    Attributes:
        indptr: ``[rows + 1]`` int64, row ``r``'s slots are ``indices[indptr[r]:indptr[r + 1]]``.
        indices: int64 attended slots, ascending within each row (a tree's path order).
        blocks: ``[rows]`` int64, the first key/value block each row reads (0: one sequence's ``[kv_heads, width,
            d]``; in a pool of sequences, its slot's — see :func:`exact_attention_blocks`).
    """

    def __init__(self, mask: torch.Tensor) -> None:
        allowed = mask.detach().to("cpu", torch.bool).numpy()
        counts = np.count_nonzero(allowed, axis=1)
        if not counts.all():
            raise ValueError("every row of an exact-attention mask must attend at least one key")
        self.indptr = np.zeros(allowed.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=self.indptr[1:])
        self.indices = np.ascontiguousarray(np.nonzero(allowed)[1], dtype=np.int64)  # a column view: copied
        self.blocks = np.zeros(allowed.shape[0], dtype=np.int64)

    @classmethod
    def of_tree(cls, parents: np.ndarray, past: int, rows: int) -> ExactPlan:
        """The plan of :class:`~hierspec.runtime.inputs.TreeInputs`' mask for a breadth-first tree (``parents``,
        parents before children) over ``past`` cached entries in a bucket of ``rows``, made from the tree itself:
        row ``i`` attends the cached slots, then ``past +`` each node on its path from the root (padding rows: their
        own slot only). The same arrays as :meth:`__init__` on that mask, in one compiled call instead of writing
        and scanning ``rows x width`` booleans each forward."""
        plan = cls.__new__(cls)
        plan.indptr, plan.indices, plan.blocks = _tree_plan(np.ascontiguousarray(parents, dtype=np.int64), past, rows)
        return plan

    @classmethod
    def concatenate(cls, plans: Sequence[ExactPlan], blocks: np.ndarray) -> ExactPlan:
        """One plan of every row of ``plans``, in order (each row's slots unchanged), its rows reading ``blocks``."""
        plan = cls.__new__(cls)
        counts = np.concatenate([np.diff(p.indptr) for p in plans])
        plan.indptr = np.zeros(counts.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=plan.indptr[1:])
        plan.indices = np.concatenate([p.indices for p in plans])
        plan.blocks = np.ascontiguousarray(blocks, dtype=np.int64)
        return plan


def exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: ExactPlan,
                    scale: float) -> torch.Tensor:
    """``query [1, heads, rows, d]`` over ``key``/``value`` ``[1, kv_heads, width, d]`` (views of a cache) →
    ``[rows, heads * d]``, query head ``j`` reading key/value head ``j // (heads / kv_heads)``."""
    work = _work_dtype(query.dtype)
    keys, values = _rows_of(key[0], work), _rows_of(value[0], work)
    return exact_attention_blocks(query, keys, values, plan, key.shape[1], scale)


def exact_attention_blocks(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: ExactPlan,
                           kv_heads: int, scale: float) -> torch.Tensor:
    """Like :func:`exact_attention`, with the keys and values of several sequences in one C-contiguous ``[blocks,
    slots, d]`` buffer each (a :class:`~hierspec.runtime.slots.SlotPool` layer viewed as ``[sequences * kv_heads,
    capacity, d]``): row ``r`` of key/value head ``h`` reads block ``plan.blocks[r] + h``, at the slots its plan
    names.
    The same arithmetic per row as alone: a batch of sequences costs one call per layer instead of one each (a
    call's Python overhead is about as much as one row's attention over a few hundred keys)."""
    _, heads, rows, dim = query.shape
    work = _work_dtype(query.dtype)
    queries = query[0].transpose(0, 1).to(work).contiguous().view(rows, kv_heads, heads // kv_heads, dim)
    out = torch.empty((rows, kv_heads, heads // kv_heads, dim), dtype=work)
    rows_in = queries.numpy()
    attend_rows(rows_in, keys.numpy(), values.numpy(), plan.indptr, plan.indices, plan.blocks,
                rows_in.dtype.type(scale), out.numpy())
    return out.view(rows, heads * dim).to(query.dtype)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in NATIVE_DTYPES else torch.float32


def _rows_of(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A C-contiguous ``[kv_heads, slots, d]`` tensor whose first ``width`` slots are ``cache``'s: the cache's own
    buffer when ``cache`` is a slot range of it (no copy), else a copy (converted to ``dtype``)."""
    heads, width, dim = cache.shape
    if cache.dtype == dtype and cache.stride(2) == 1 and cache.stride(1) == dim and cache.stride(0) % dim == 0 \
            and cache.stride(0) >= width * dim:
        return cache.as_strided((heads, cache.stride(0) // dim, dim), (cache.stride(0), dim, 1))
    return cache.to(dtype).contiguous()


#: Cephes' ``expf``: ln 2 split in two for the range reduction, and the polynomial of ``e^r`` on ``|r| <= ln2 / 2``
_LOG2E = np.float32(1.44269504088896341)
_LN2_HIGH = np.float32(0.693359375)
_LN2_LOW = np.float32(-2.12194440e-4)
_EXP_POLY = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
             np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))
#: below this, exp underflows float32's normal range (the weight is ~1e-38, not 0)
_EXP_FLOOR = np.float32(-87.0)


@njit(nogil=True, cache=True)
def _tree_plan(parents, past, rows):  # pragma: no cover - compiled
    """``(indptr [rows + 1], indices, blocks [rows])`` of a tree's rows: row ``r`` reads slots ``0 .. past - 1``,
    then ``past + a`` for each node ``a`` on its path from the root (ascending: parents precede children); a padding
    row ``r >= n`` reads ``past + r`` alone; every row block 0."""
    n = parents.shape[0]
    depths = np.zeros(n, dtype=np.int64)
    for node in range(1, n):
        depths[node] = depths[parents[node]] + 1
    indptr = np.empty(rows + 1, dtype=np.int64)
    indptr[0] = 0
    for row in range(rows):
        indptr[row + 1] = indptr[row] + past + (depths[row] + 1 if row < n else 1)
    indices = np.empty(indptr[rows], dtype=np.int64)
    for row in range(rows):
        at = indptr[row]
        for slot in range(past):
            indices[at + slot] = slot
        node = row if row < n else -1
        end = indptr[row + 1]
        if node < 0:
            indices[end - 1] = past + row
        while node >= 0:  # the path from the row's node up to the root, written from its end
            end -= 1
            indices[end] = past + node
            node = parents[node]
    return indptr, indices, np.zeros(rows, dtype=np.int64)


@njit(nogil=True, cache=True, fastmath={"contract"})
def _exp_shifted(line, top, out, exponents, powers):  # pragma: no cover - compiled
    """``out[j] = exp(line[j] - top)`` for float32 ``line`` (every value <= ``top``), ~1 ulp as Cephes' ``expf``;
    ``powers`` is ``exponents`` viewed as float32 (``2 ** n`` built in its bits).

    Written as plain arithmetic so the compiler vectorises it (libm's ``expf`` is a scalar call, ~40 % of the
    kernel's time); no ``reassoc`` here, which would fold the two-part ln 2 of the range reduction."""
    c0, c1, c2, c3, c4, c5 = _EXP_POLY
    count = line.shape[0]
    for j in range(count):
        x = max(line[j] - top, _EXP_FLOOR)
        n = np.floor(x * _LOG2E + np.float32(0.5))
        r = x - n * _LN2_HIGH
        r = r - n * _LN2_LOW
        p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
        out[j] = (r * r) * p + r + np.float32(1)
        exponents[j] = (np.int32(n) + np.int32(127)) << np.int32(23)
    for j in range(count):
        out[j] = out[j] * powers[j]


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def attend_rows(query, keys, values, indptr, indices, blocks, scale, out):  # pragma: no cover - compiled
    """``out[r, h, g] = softmax(scale * query[r, h, g] · keys[b, s]) · values[b, s]`` over row ``r``'s slots ``s``,
    ``b = blocks[r] + h``.

    One task per (row, key/value head); its arithmetic reads nothing of other rows, and every loop runs over the
    row's own key sequence (its length and order are the same alone, in a chain or in any tree), so rows in other
    numbers change no bit. ``reassoc`` lets the compiler vectorise the dot products and sums in an order fixed by
    the loop lengths alone. Scores go to a scratch row per query head, are exponentiated (float32: the vectorised
    :func:`_exp_shifted`; float64: ``np.exp``), weight the values into an accumulator, and the sum is divided by
    the softmax's total once per output element. Single-threaded: numba's parallel threads (its OpenMP layer) hang
    a process forked after them (the store builders' fault tests fork), and two Python threads sharing the tasks
    measured slower (PyTorch's OpenMP threads still spin on the second core after each product).
    """
    rows, kv_heads, groups, dim = query.shape
    width = keys.shape[1]
    scores = np.empty((groups, width), dtype=query.dtype)
    exponents = np.empty(width, dtype=np.int32)
    powers = exponents.view(np.float32)
    weights = np.empty(width, dtype=query.dtype)
    totals = np.empty(groups, dtype=query.dtype)
    result = np.empty((groups, dim), dtype=query.dtype)
    # a zero of the query's type made once: starting each dot product from a value read out of an array kept the
    # compiler from vectorising the loop (0.25 instead of 0.12 ms for 16 rows over 200 keys)
    zero = np.zeros(1, dtype=query.dtype)[0]
    for task in range(rows * kv_heads):
        row = task // kv_heads
        head = task - row * kv_heads
        block = blocks[row] + head
        start = indptr[row]
        count = indptr[row + 1] - start
        # keys four at a time (the query element read once for four products), then the rest one by one: which
        # of the two loops scores key j depends on j and count alone, both the same wherever the row is verified
        whole = count - count % 4
        for j in range(0, whole, 4):
            s0, s1, s2, s3 = indices[start + j], indices[start + j + 1], indices[start + j + 2], indices[start + j + 3]
            for g in range(groups):
                t0 = t1 = t2 = t3 = zero
                for d in range(dim):
                    q = query[row, head, g, d]
                    t0 += q * keys[block, s0, d]
                    t1 += q * keys[block, s1, d]
                    t2 += q * keys[block, s2, d]
                    t3 += q * keys[block, s3, d]
                scores[g, j], scores[g, j + 1] = t0 * scale, t1 * scale
                scores[g, j + 2], scores[g, j + 3] = t2 * scale, t3 * scale
        for j in range(whole, count):
            slot = indices[start + j]
            for g in range(groups):
                total = zero
                for d in range(dim):
                    total += query[row, head, g, d] * keys[block, slot, d]
                scores[g, j] = total * scale
        for g in range(groups):
            line = scores[g, :count]
            top = line[0]
            for j in range(1, count):
                top = max(top, line[j])
            if query.itemsize == 4:
                _exp_shifted(line, top, weights, exponents, powers)
            else:
                for j in range(count):
                    weights[j] = np.exp(line[j] - top)
            norm = zero
            for j in range(count):
                norm += weights[j]
                line[j] = weights[j]
            totals[g] = norm
        result[:] = 0
        for j in range(0, whole, 4):  # four weighted values summed per store of the accumulator
            s0, s1, s2, s3 = indices[start + j], indices[start + j + 1], indices[start + j + 2], indices[start + j + 3]
            for g in range(groups):
                w0, w1, w2, w3 = scores[g, j], scores[g, j + 1], scores[g, j + 2], scores[g, j + 3]
                for d in range(dim):
                    result[g, d] += (w0 * values[block, s0, d] + w1 * values[block, s1, d]) + (
                        w2 * values[block, s2, d] + w3 * values[block, s3, d])
        for j in range(whole, count):
            slot = indices[start + j]
            for g in range(groups):
                weight = scores[g, j]
                for d in range(dim):
                    result[g, d] += weight * values[block, slot, d]
        for g in range(groups):
            for d in range(dim):
                out[row, head, g, d] = result[g, d] / totals[g]
