"""Time exact CUDA tree attention (:mod:`hierspec.runtime.cuda_attention`) against SDPA on the tree mask, per
layer, at the attention shapes of SmolLM2-135M and Qwen2.5-1.5B, for several kernel shapes (keys a block, warps,
pipeline stages, logical keys a chunk); every shape is first checked against the row-by-row reference and for rows
whose bits move with their slots.

    python scripts/cuda_attention_bench.py [--out results.jsonl]

Thirty calls (one per layer) are captured in one CUDA graph and replayed, as the graphed runtime runs them, so
launch overhead from Python is not counted. The shape marked ``default`` is what the runtime uses.
"""

from __future__ import annotations

import argparse
import json

import torch

from hierspec.runtime import cuda_attention
from hierspec.runtime.attention import tree_attention
from hierspec.tree import build_tree, padded_ancestor_matrix

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}
KernelShape = cuda_attention.KernelShape
SHAPES_TRIED = [KernelShape(16, 4), KernelShape(64, 8), KernelShape(32, 4, 2), KernelShape(64, 4, chunk=128),
                KernelShape(64, 8, chunk=256), KernelShape(32, 4, chunk=256), KernelShape(32, 4, chunk=128),
                KernelShape(16, 4, chunk=128), KernelShape(64, 8, chunk=512), KernelShape(32, 4, 2, chunk=256)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
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
            default = cuda_attention.default_shape(heads // kv_heads, dim)
            for shape in [default] + [s for s in SHAPES_TRIED if s != default]:
                out = cuda_attention.attend(query, key, value, plan, scale, shape)
                error = float((out.double() - expected).abs().max())
                exact = cuda_attention.first_row_whose_bits_move(
                    lambda *inputs: cuda_attention.attend(*inputs, shape), query, key, value, plan, tree.size,
                    scale) is None
                us = graph_time_us(lambda: cuda_attention.attend(query, key, value, plan, scale, shape))
                label = "b{}-w{}-s{}-c{}".format(shape.block, shape.warps, shape.stages, shape.chunk)
                record["variants"][label] = {"us": round(us, 2), "max_error": error, "rows_exact": exact,
                                            "default": shape == default}
            print(json.dumps(record), flush=True)
            records.append(record)
    if args.out:
        with open(args.out, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
