"""Time exact CUDA tree attention (:mod:`hierspec.runtime.cuda_attention`) against SDPA on the tree mask, per
layer, at the attention shapes of SmolLM2-135M and Qwen2.5-1.5B, for several kernel block sizes, warps and
pipeline stages; every variant is checked against the row-by-row reference first.

    python scripts/cuda_attention_bench.py [--out results.jsonl]
    python scripts/cuda_attention_bench.py --split [--out results.jsonl]   # the split-key candidate too

Thirty calls (one per layer) are captured in one CUDA graph and replayed, as the graphed runtime runs them, so
launch overhead from Python is not counted.

``--split`` adds a candidate not yet in the runtime (written without a GPU on 2026-12-04, checked only in Triton's
interpreter): the one-pass kernel walks all of a row's keys in one program, several times slower than SDPA over
~2,000 keys; here each program takes one chunk of ``CHUNK`` *logical* keys (chunk boundaries fixed by the row's own
key sequence, not by slots) and writes its partial softmax, and a second kernel merges a row's chunks in order. A
row's bits then still depend on its query and logical keys alone; the script checks that (a row moved to another
slot layout and row position gives the same bits) before it times anything.
"""

from __future__ import annotations

import argparse
import json

import torch

from hierspec.runtime import cuda_attention
from hierspec.runtime.attention import tree_attention
from hierspec.tree import build_tree, padded_ancestor_matrix

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}
#: split-key candidates: (logical keys a chunk, keys a block, warps)
SPLITS = [(128, 64, 4), (256, 64, 8), (256, 32, 4), (512, 64, 8)]
VARIANTS = [(16, 4, 1), (32, 4, 1), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 2), (32, 2, 2), (16, 2, 2)]
LAYERS = 30


def graph_time_us(call, repeats: int = 50) -> float:
    """Microseconds per call: ``LAYERS`` calls captured in one graph, replayed ``repeats`` times."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (repeats * LAYERS)


triton = cuda_attention.triton
if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["q_head", "q_row", "k_head", "k_slot", "v_head", "v_slot", "plan_row", "chunks"])
    def _chunk_partials(q_ptr, k_ptr, v_ptr, plan_ptr, part_ptr, scale, q_head, q_row, k_head, k_slot, v_head, v_slot,
                        plan_row, chunks, GROUPS: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
                        DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        """One (row, key/value head, chunk): the softmax partial (top, total, weighted values) of the row's logical
        keys ``chunk * CHUNK ..`` (the last chunk cut at the row's key count), by the runtime kernel's own walk."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        chunk = tl.program_id(2)
        plan = plan_ptr + row * plan_row
        context = tl.load(plan)
        keys = tl.load(plan + 1)
        begin = chunk * CHUNK
        if begin < keys:
            top, total, acc = cuda_attention.softmax_over_keys(
                q_ptr, k_ptr, v_ptr, plan, context, keys, begin, begin + CHUNK, scale, row, kv_head, q_head, q_row,
                k_head, k_slot, v_head, v_slot, GROUPS, GROUP_PAD, DIM, DIM_PAD, BLOCK)
            group = tl.arange(0, GROUP_PAD)
            dims = tl.arange(0, DIM_PAD)
            width = DIM_PAD + 2
            base = part_ptr + ((row * tl.num_programs(1) + kv_head) * chunks + chunk) * GROUP_PAD * width
            tl.store(base + group[:, None] * width + dims[None, :], acc)
            tl.store(base + group * width + DIM_PAD, top)
            tl.store(base + group * width + DIM_PAD + 1, total)

    @triton.jit(do_not_specialize=["plan_row", "chunks", "o_row", "o_head"])
    def _merge_chunks(plan_ptr, part_ptr, o_ptr, plan_row, chunks, o_row, o_head, GROUPS: tl.constexpr,
                      GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, CHUNK: tl.constexpr):
        """One (row, key/value head): the row's chunk partials merged in chunk order."""
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
        cuda_attention.store_rows(o_ptr, row, kv_head, o_row, o_head, acc, total, GROUPS, GROUP_PAD, DIM, DIM_PAD)


def attend_split(query, key, value, plan, scale, split):
    """The split-key candidate: ``cuda_attention.attend``'s inputs and output, ``split = (chunk, block, warps)``."""
    chunk, block, warps = split
    _, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    group_pad, dim_pad = triton.next_power_of_2(groups), triton.next_power_of_2(dim)
    chunks = -(-key.shape[2] // chunk)  # by the cache's width, the same every forward (a graph's grid is fixed)
    part = torch.empty((rows, kv_heads, chunks, group_pad, dim_pad + 2), dtype=torch.float32, device=query.device)
    _chunk_partials[(rows, kv_heads, chunks)](
        query, key, value, plan, part, float(scale), query.stride(1), query.stride(2), key.stride(1), key.stride(2),
        value.stride(1), value.stride(2), plan.stride(0), chunks, GROUPS=groups, GROUP_PAD=group_pad, DIM=dim,
        DIM_PAD=dim_pad, BLOCK=block, CHUNK=chunk, num_warps=warps)
    out = torch.empty((1, rows, heads, dim), dtype=query.dtype, device=query.device)
    _merge_chunks[(rows, kv_heads)](plan, part, out, plan.stride(0), chunks, out.stride(1), out.stride(2),
                                    GROUPS=groups, GROUP_PAD=group_pad, DIM=dim, DIM_PAD=dim_pad, CHUNK=chunk,
                                    num_warps=4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--split", action="store_true", help="also check and time the split-key candidate")
    args = parser.parse_args()
    rows = 16
    tree = build_tree(7, [[1, 2, 3, 4], [1, 5], [6, 7, 8], [9]])
    block_matrix = padded_ancestor_matrix(tree, rows)
    records = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for past, width in ((300, 1024), (1900, 2048)):
            torch.manual_seed(0)
            plan = torch.from_numpy(cuda_attention.row_plan(block_matrix, past)).cuda()
            query = torch.randn(1, rows, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            key, value = (torch.randn(1, kv_heads, width, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            scale = dim ** -0.5
            expected = cuda_attention.attend_reference(query.double(), key.double(), value.double(), plan, scale)
            mask = torch.zeros((rows, width), dtype=torch.bool)
            mask[:, :past] = True
            mask[:, past : past + rows] = torch.from_numpy(block_matrix)
            folded = mask.repeat(heads // kv_heads, 1)[None, None].cuda()
            sdpa_us = graph_time_us(lambda: tree_attention(None, query, key, value, folded, scaling=scale))
            record = {"shape": name, "past": past, "width": width, "sdpa_us": round(sdpa_us, 2), "variants": {}}
            for block, warps, stages in VARIANTS:
                variant = (block, warps, stages)
                out = cuda_attention.attend(query, key, value, plan, scale, variant)
                error = float((out.double() - expected).abs().max())
                us = graph_time_us(lambda: cuda_attention.attend(query, key, value, plan, scale, variant))
                record["variants"][f"b{block}-w{warps}-s{stages}"] = {"us": round(us, 2), "max_error": error}
            for split in SPLITS if args.split else ():
                out = attend_split(query, key, value, plan, scale, split)
                error = float((out.double() - expected).abs().max())
                exact = cuda_attention.first_row_whose_bits_move(
                    lambda *args: attend_split(*args, split), query, key, value, plan, tree.size, scale) is None
                us = graph_time_us(lambda: attend_split(query, key, value, plan, scale, split))
                record["variants"]["split-c{}-b{}-w{}".format(*split)] = {"us": round(us, 2), "max_error": error,
                                                                          "rows_exact": exact}
            print(json.dumps(record), flush=True)
            records.append(record)
    if args.out:
        with open(args.out, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
