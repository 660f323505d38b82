"""Time exact CUDA tree attention (:mod:`hierspec.runtime.cuda_attention`) against SDPA on the tree mask, per
layer, at the attention shapes of SmolLM2-135M and Qwen2.5-1.5B, for several kernel block sizes, warps and
pipeline stages; every variant is checked against the row-by-row reference first.

    python scripts/cuda_attention_bench.py [--out results.jsonl]

Thirty calls (one per layer) are captured in one CUDA graph and replayed, as the graphed runtime runs them, so
launch overhead from Python is not counted.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from hierspec.runtime import cuda_attention
from hierspec.runtime.attention import tree_attention
from hierspec.tree import ancestor_matrix, build_tree

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = 16
    tree = build_tree(7, [[1, 2, 3, 4], [1, 5], [6, 7, 8], [9]])
    block_matrix = np.eye(rows, dtype=bool)
    block_matrix[: tree.size, : tree.size] = ancestor_matrix(tree)
    records = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for past, width in ((300, 1024), (1900, 2048)):
            torch.manual_seed(0)
            plan_host = np.zeros((rows, 2 + rows), dtype=np.int32)
            cuda_attention.write_row_plan(block_matrix, past, plan_host)
            plan = torch.from_numpy(plan_host).cuda()
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
            print(json.dumps(record), flush=True)
            records.append(record)
    if args.out:
        with open(args.out, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
