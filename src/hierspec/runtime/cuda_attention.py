"""Exact tree attention on CUDA: every tree row's attention bit-identical to the same token in plain decoding.

GPU attention kernels (PyTorch's SDPA) sum a row's keys in lanes and blocks laid out by the *slots* the keys sit
in. A node of a second branch sees its ancestors at breadth-first slots, with other branches' nodes masked between
them, while plain decoding puts the same tokens in consecutive slots: the sums pair up differently, the last bits
of bfloat16 logits move, and near-ties flip (on an H200, 2026-12-04: `hd` left bfloat16 plain decoding on 7 of 13
dev questions while chains, `pld`, stayed identical; BENCHMARKS.md). Here one Triton program per (row, key/value
head) walks the row's *logical* key sequence — the cached context, then the row's path from the root — in blocks of
a fixed size, with an online softmax in float32; its arithmetic reads nothing of other rows and depends on that
sequence alone, so a token gives the same bits alone, in a chain or at any depth of any tree, in a forward of any
row count. At long contexts one program a row leaves most of the GPU idle, so by default the sequence is cut into
chunks of a fixed number of *logical* keys, one program each, whose partial softmaxes a second kernel merges in
chunk order (:class:`KernelShape`); the bounds still follow the row's own key sequence, so the bits stay the row's.
The CPU's counterpart is :mod:`hierspec.runtime.exact_attention`.

Each forward's rows are described by a *row plan*, int32 ``[rows, 2 + rows]``: ``(context, keys, path...)`` —
row ``r`` attends slots ``0 .. context - 1`` and then ``path[0 .. keys - context - 1]``. The graphed runtime writes
it once per forward (:func:`write_row_plan`) and hands it to the attention function in place of the boolean mask
(transformers passes a 4-D mask through untouched). Integer arguments are not specialised and every pointer the
kernel reads is a whole allocation or a slot-0 view of the cache, so one compiled kernel serves every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

try:  # Triton ships with PyTorch's CUDA builds; CPU-only builds come without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the PyTorch build
    triton = None

#: the row plan's dtype: a 4-D attention mask of this dtype is a row plan, not a mask
PLAN_DTYPE = torch.int32


@dataclass(frozen=True)
class KernelShape:
    """How the kernel walks a row's keys: ``block`` keys a step, ``warps`` a program, ``stages`` of software
    pipelining (``None``: Triton's default), and ``chunk`` — ``None`` for one program over all of a row's keys, or a
    number of *logical* keys each program takes, the row's chunk partials then merged in chunk order by a second
    kernel (more programs at long contexts). Any fixed shape keeps rows exact; it only has to be the same for every
    forward of a model (plain decoding's included)."""

    block: int
    warps: int
    stages: int | None = None
    chunk: int | None = None


#: the shapes by the padded query heads x head dimensions of a key/value head: SmolLM2's (3 x 64) and
#: Qwen2.5-1.5B's (6 x 128) on an H200 (scripts/cuda_attention_bench.py, BENCHMARKS.md)
_SMALL_HEADS = KernelShape(32, 4, chunk=128)
_LARGE_HEADS = KernelShape(16, 4, chunk=128)


def default_shape(groups: int, dim: int) -> KernelShape:
    """The kernel shape for ``groups`` query heads a key/value head of ``dim`` dimensions."""
    return _SMALL_HEADS if triton.next_power_of_2(groups) * triton.next_power_of_2(dim) <= 256 else _LARGE_HEADS


#: model dtypes the Triton kernels here and in :mod:`~hierspec.runtime.cuda_fusion` serve (they compute in float32:
#: a float64 model keeps PyTorch's operations)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_unavailable(device: torch.device, dtype: torch.dtype, what: str) -> str | None:
    """Why float32 Triton kernels (``what``, for the message) cannot serve a model in ``dtype`` on ``device``
    (``None`` when they can)."""
    if device.type != "cuda":
        return f"{what}: needs a CUDA device"
    if dtype not in DTYPES:
        return f"{what}: computes in float32, not for a {str(dtype).removeprefix('torch.')} model"
    if triton is None:
        return f"{what}: needs Triton (installed with PyTorch's CUDA builds)"
    return None


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why exact tree attention cannot run on ``device`` for a model in ``dtype`` (``None`` when it can)."""
    return triton_unavailable(device, dtype, "exact CUDA attention")


def write_row_plan(block: np.ndarray, past: int, out: np.ndarray) -> None:
    """Write the row plan of a forward into ``out`` (int32 ``[rows, 2 + rows]``).

    ``block`` is the boolean ``[rows, rows]`` matrix of the forward's own rows each row attends (a tree's ancestor
    matrix, itself included; a padding row itself only), ``past`` the number of cached entries before them. For a
    breadth-first tree the attended rows in ascending order are the row's path from the root."""
    rows = block.shape[0]
    out[:, 0] = past
    out[:, 1] = past + np.count_nonzero(block, axis=1)
    out[:, 2 : 2 + rows] = past + np.argsort(~block, axis=1, kind="stable")


def row_plan(block: np.ndarray, past: int) -> np.ndarray:
    """A new row plan of a forward (:func:`write_row_plan` into a fresh array)."""
    plan = np.zeros((block.shape[0], 2 + block.shape[0]), dtype=np.int32)
    write_row_plan(block, past, plan)
    return plan


def plan_slots(plan: torch.Tensor, row: int) -> torch.Tensor:
    """The slots row ``row`` of a row plan attends, in its logical order."""
    context, keys = int(plan[row, 0]), int(plan[row, 1])
    return torch.cat((torch.arange(context, device=plan.device), plan[row, 2 : 2 + keys - context].long()))


def attend_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """What :func:`attend` computes, row by row with PyTorch's operations (tests): ``[1, rows, heads, d]``."""
    _, heads, rows, dim = query.shape
    groups = heads // key.shape[1]
    out = torch.empty((1, rows, heads, dim), dtype=query.dtype, device=query.device)
    for row in range(rows):
        slots = plan_slots(plan, row)
        for head in range(heads):
            keys, values = key[0, head // groups, slots], value[0, head // groups, slots]
            weights = torch.softmax((keys @ query[0, head, row]) * scale, dim=0)
            out[0, row, head] = weights @ values
    return out


def first_row_whose_bits_move(attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              plan: torch.Tensor, rows: int, scale: float) -> int | None:
    """The first of the forward's first ``rows`` rows whose ``attention(query, key, value, plan, scale)`` output
    changes in any bit when the same query heads a 32-row forward over keys that hold the row's logical keys at
    consecutive slots (where plain decoding keeps them); ``None`` when no row's does (tests and the bench script)."""
    out = attention(query, key, value, plan, scale)
    for row in range(rows):
        slots = plan_slots(plan, row)
        moved_key, moved_value = key.clone(), value.clone()
        moved_key[:, :, : len(slots)], moved_value[:, :, : len(slots)] = key[:, :, slots], value[:, :, slots]
        alone_plan = torch.from_numpy(row_plan(np.eye(32, dtype=bool), len(slots) - 1)).to(plan.device)
        alone_query = torch.zeros_like(query[:, :, :1]).repeat(1, 1, 32, 1)
        alone_query[:, :, 0] = query[:, :, row]
        if not torch.equal(attention(alone_query, moved_key, moved_value, alone_plan, scale)[0, 0], out[0, row]):
            return row
    return None


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: torch.Tensor, scale: float,
           shape: KernelShape | None = None) -> torch.Tensor:
    """Attention of ``query [1, heads, rows, d]`` over ``key``/``value`` ``[1, kv_heads, slots, d]`` (views of a
    cache, last dimension contiguous) as ``plan`` (int32 ``[rows, 2 + P]``) says; returns ``[1, rows, heads, d]``
    in the query's dtype, computed in float32. ``shape`` overrides :func:`default_shape` (the bench script times
    several)."""
    _, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1 or plan.stride(1) != 1:
        raise ValueError("exact CUDA attention needs the head dimension contiguous")
    shape = shape or default_shape(groups, dim)
    out = torch.empty((1, rows, heads, dim), dtype=query.dtype, device=query.device)
    group_pad, dim_pad = triton.next_power_of_2(groups), triton.next_power_of_2(dim)
    heads_and_dims = {"GROUPS": groups, "GROUP_PAD": group_pad, "DIM": dim, "DIM_PAD": dim_pad}
    launch = {"num_warps": shape.warps, **({} if shape.stages is None else {"num_stages": shape.stages})}
    strides = (query.stride(1), query.stride(2), key.stride(1), key.stride(2), value.stride(1), value.stride(2),
               plan.stride(0))
    if shape.chunk is None:
        _attend_rows[(rows, kv_heads)](query, key, value, plan, out, float(scale), *strides, out.stride(1),
                                       out.stride(2), BLOCK=shape.block, **heads_and_dims, **launch)
        return out
    chunks = -(-key.shape[2] // shape.chunk)  # by the cache's width, the same every forward (a graph's grid is fixed)
    partials = torch.empty((rows, kv_heads, chunks, group_pad, dim_pad + 2), dtype=torch.float32, device=query.device)
    _chunk_partials[(rows, kv_heads, chunks)](query, key, value, plan, partials, float(scale), *strides, chunks,
                                              BLOCK=shape.block, CHUNK=shape.chunk, **heads_and_dims, **launch)
    _merge_chunks[(rows, kv_heads)](plan, partials, out, plan.stride(0), chunks, out.stride(1), out.stride(2),
                                    CHUNK=shape.chunk, **heads_and_dims, num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def softmax_over_keys(q_ptr, k_ptr, v_ptr, plan, context, keys, first, stop, scale, row, kv_head, q_head, q_row,
                          k_head, k_slot, v_head, v_slot, GROUPS: tl.constexpr, GROUP_PAD: tl.constexpr,
                          DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK: tl.constexpr):  # pragma: no cover - GPU
        """``(top, total, acc)`` — the running maximum, sum of weights and weighted values in float32 — of the
        grouped query heads of ``row`` over its logical keys ``first .. stop - 1`` (those below ``keys``), in blocks of
        ``BLOCK`` keys from ``first``; ``plan`` points at the row's plan. Shared by the one-pass and the
        split-key kernels."""
        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUPS + group
        live = (group[:, None] < GROUPS) & (dims[None, :] < DIM)
        query = tl.load(q_ptr + heads[:, None] * q_head + row * q_row + dims[None, :], mask=live,
                        other=0.0).to(tl.float32)
        top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for start in tl.range(first, stop, BLOCK):
            n = start + tl.arange(0, BLOCK)
            valid = n < keys
            on_path = tl.load(plan + 2 + (n - context), mask=valid & (n >= context), other=0)
            slot = tl.where(n < context, n, on_path)
            entry = valid[:, None] & (dims[None, :] < DIM)
            k = tl.load(k_ptr + kv_head * k_head + slot[:, None] * k_slot + dims[None, :], mask=entry,
                        other=0.0).to(tl.float32)
            scores = tl.sum(query[:, None, :] * k[None, :, :], axis=2) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            rescale = tl.exp(top - new_top)
            weights = tl.exp(scores - new_top[:, None])
            total = total * rescale + tl.sum(weights, axis=1)
            v = tl.load(v_ptr + kv_head * v_head + slot[:, None] * v_slot + dims[None, :], mask=entry,
                        other=0.0).to(tl.float32)
            acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
            top = new_top
        return top, total, acc

    @triton.jit
    def store_rows(o_ptr, row, kv_head, o_row, o_head, acc, total, GROUPS: tl.constexpr, GROUP_PAD: tl.constexpr,
                   DIM: tl.constexpr, DIM_PAD: tl.constexpr):  # pragma: no cover - runs on a GPU
        """Write ``acc / total`` of ``row``'s grouped query heads (the padding heads and dimensions left out)."""
        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUPS + group
        live = (group[:, None] < GROUPS) & (dims[None, :] < DIM)
        tl.store(o_ptr + row * o_row + heads[:, None] * o_head + dims[None, :],
                 (acc / total[:, None]).to(o_ptr.dtype.element_ty), mask=live)

    @triton.jit(do_not_specialize=["q_head", "q_row", "k_head", "k_slot", "v_head", "v_slot", "plan_row", "o_row",
                                   "o_head"])
    def _attend_rows(q_ptr, k_ptr, v_ptr, plan_ptr, o_ptr, scale, q_head, q_row, k_head, k_slot, v_head, v_slot,
                     plan_row, o_row, o_head, GROUPS: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
                     DIM_PAD: tl.constexpr, BLOCK: tl.constexpr):  # pragma: no cover - runs on a GPU
        """One (row, key/value head): the grouped query heads of that row over all the row's logical keys, in
        blocks of ``BLOCK`` keys, online softmax in float32."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        plan = plan_ptr + row * plan_row
        context = tl.load(plan)
        keys = tl.load(plan + 1)
        top, total, acc = softmax_over_keys(q_ptr, k_ptr, v_ptr, plan, context, keys, 0, keys, scale, row, kv_head,
                                            q_head, q_row, k_head, k_slot, v_head, v_slot, GROUPS, GROUP_PAD, DIM,
                                            DIM_PAD, BLOCK)
        store_rows(o_ptr, row, kv_head, o_row, o_head, acc, total, GROUPS, GROUP_PAD, DIM, DIM_PAD)

    @triton.jit(do_not_specialize=["q_head", "q_row", "k_head", "k_slot", "v_head", "v_slot", "plan_row", "chunks"])
    def _chunk_partials(q_ptr, k_ptr, v_ptr, plan_ptr, part_ptr, scale, q_head, q_row, k_head, k_slot, v_head, v_slot,
                        plan_row, chunks, GROUPS: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
                        DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):  # pragma: no cover - GPU
        """One (row, key/value head, chunk): the softmax partial (top, total, weighted values) of the row's logical
        keys ``chunk * CHUNK ..`` (the last chunk cut at the row's key count); chunks past the row's keys do
        nothing. Chunk bounds follow the row's own key sequence, never slots, so a row's bits stay its own."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        chunk = tl.program_id(2)
        plan = plan_ptr + row * plan_row
        context = tl.load(plan)
        keys = tl.load(plan + 1)
        begin = chunk * CHUNK
        if begin < keys:
            stop = tl.minimum(begin + CHUNK, keys)
            top, total, acc = softmax_over_keys(q_ptr, k_ptr, v_ptr, plan, context, keys, begin, stop, scale, row,
                                                kv_head, q_head, q_row, k_head, k_slot, v_head, v_slot, GROUPS,
                                                GROUP_PAD, DIM, DIM_PAD, BLOCK)
            group = tl.arange(0, GROUP_PAD)
            dims = tl.arange(0, DIM_PAD)
            width = DIM_PAD + 2
            base = part_ptr + ((row * tl.num_programs(1) + kv_head) * chunks + chunk) * GROUP_PAD * width
            tl.store(base + group[:, None] * width + dims[None, :], acc)
            tl.store(base + group * width + DIM_PAD, top)
            tl.store(base + group * width + DIM_PAD + 1, total)

    @triton.jit(do_not_specialize=["plan_row", "chunks", "o_row", "o_head"])
    def _merge_chunks(plan_ptr, part_ptr, o_ptr, plan_row, chunks, o_row, o_head, GROUPS: tl.constexpr,
                      GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                      CHUNK: tl.constexpr):  # pragma: no cover - runs on a GPU
        """One (row, key/value head): the row's chunk partials merged in chunk order, then stored."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        keys = tl.load(plan_ptr + row * plan_row + 1)
        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM_PAD)
        width = DIM_PAD + 2
        top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for chunk in tl.range(0, (keys + CHUNK - 1) // CHUNK):
            base = part_ptr + ((row * tl.num_programs(1) + kv_head) * chunks + chunk) * GROUP_PAD * width
            part_top = tl.load(base + group * width + DIM_PAD)
            new_top = tl.maximum(top, part_top)
            mine, theirs = tl.exp(top - new_top), tl.exp(part_top - new_top)
            total = total * mine + tl.load(base + group * width + DIM_PAD + 1) * theirs
            acc = acc * mine[:, None] + tl.load(base + group[:, None] * width + dims[None, :]) * theirs[:, None]
            top = new_top
        store_rows(o_ptr, row, kv_head, o_row, o_head, acc, total, GROUPS, GROUP_PAD, DIM, DIM_PAD)
