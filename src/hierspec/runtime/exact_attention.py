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
~120 µs for that split). Its work grows with rows x keys on one thread, so a forward of many rows costs more than
with PyTorch's attention (int4 SmolLM2, 200-token context: equal at 1–2 rows, +18 % at 16; BENCHMARKS.md). Low-precision
caches (bfloat16, float16) are attended in float32, as PyTorch's CPU attention accumulates them, and rounded back.
"""

from __future__ import annotations

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
    """

    def __init__(self, mask: torch.Tensor) -> None:
        allowed = mask.detach().to("cpu", torch.bool).numpy()
        if not allowed.any(axis=1).all():
            raise ValueError("every row of an exact-attention mask must attend at least one key")
        self.indptr = np.zeros(allowed.shape[0] + 1, dtype=np.int64)
        np.cumsum(allowed.sum(axis=1), out=self.indptr[1:])
        self.indices = np.nonzero(allowed)[1].astype(np.int64)


def exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: ExactPlan,
                    scale: float) -> torch.Tensor:
    """``query [1, heads, rows, d]`` over ``key``/``value`` ``[1, kv_heads, width, d]`` (views of a cache) →
    ``[rows, heads * d]``, query head ``j`` reading key/value head ``j // (heads / kv_heads)``."""
    _, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    dtype = query.dtype
    work = dtype if dtype in NATIVE_DTYPES else torch.float32
    queries = query[0].transpose(0, 1).to(work).contiguous().view(rows, kv_heads, heads // kv_heads, dim)
    keys, values = _rows_of(key[0], work), _rows_of(value[0], work)
    out = torch.empty((rows, kv_heads, heads // kv_heads, dim), dtype=work)
    rows_in = queries.numpy()
    attend_rows(rows_in, keys.numpy(), values.numpy(), plan.indptr, plan.indices, rows_in.dtype.type(scale),
                out.numpy())
    return out.view(rows, heads * dim).to(dtype)


def _rows_of(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A C-contiguous ``[kv_heads, slots, d]`` tensor whose first ``width`` slots are ``cache``'s: the cache's own
    buffer when ``cache`` is a slot range of it (no copy), else a copy (converted to ``dtype``)."""
    heads, width, dim = cache.shape
    if cache.dtype == dtype and cache.stride(2) == 1 and cache.stride(1) == dim and cache.stride(0) % dim == 0 \
            and cache.stride(0) >= width * dim:
        return cache.as_strided((heads, cache.stride(0) // dim, dim), (cache.stride(0), dim, 1))
    return cache.to(dtype).contiguous()


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def attend_rows(query, keys, values, indptr, indices, scale, out):  # pragma: no cover - compiled
    """``out[r, h, g] = softmax(scale * query[r, h, g] · keys[h, s]) · values[h, s]`` over row ``r``'s slots ``s``.

    One task per (row, key/value head); its arithmetic reads nothing of other rows, so rows in other numbers change
    no bit. Single-threaded: numba's parallel threads (its OpenMP layer) hang a process forked after them (the store
    builders' fault tests fork), and on one row the second thread saved only ~3 % of a SmolLM2 int4 step.
    ``reassoc`` lets the compiler vectorise each 1 x d dot product — the same
    instruction sequence for every key (key rows are equally aligned), so a score is still a function of its two
    vectors alone.
    """
    rows, kv_heads, groups, dim = query.shape
    for task in range(rows * kv_heads):
        row = task // kv_heads
        head = task - row * kv_heads
        start = indptr[row]
        count = indptr[row + 1] - start
        scores = np.empty((groups, count), dtype=query.dtype)
        own = query[row, head]
        for j in range(count):
            key = keys[head, indices[start + j]]
            for g in range(groups):
                total = own[g, 0] * key[0]
                for d in range(1, dim):
                    total += own[g, d] * key[d]
                scores[g, j] = total * scale
        for g in range(groups):
            top = scores[g, 0]
            for j in range(1, count):
                top = max(top, scores[g, j])
            norm = scores[g, 0] * 0
            for j in range(count):
                weight = np.exp(scores[g, j] - top)
                scores[g, j] = weight
                norm += weight
            for j in range(count):
                scores[g, j] /= norm
        result = np.zeros((groups, dim), dtype=query.dtype)
        for j in range(count):
            value = values[head, indices[start + j]]
            for g in range(groups):
                weight = scores[g, j]
                for d in range(dim):
                    result[g, d] += weight * value[d]
        out[row, head] = result
