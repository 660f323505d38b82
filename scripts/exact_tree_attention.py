"""What exact tree attention costs per layer against PyTorch's SDPA (issue 33, item 4; BENCHMARKS.md "Exact tree
attention").

    python scripts/exact_tree_attention.py [--threads 2]

:mod:`hierspec.runtime.exact_attention` makes every tree row bit-identical to the same token in plain decoding
(``tests/test_exact_attention.py`` checks it on random trees); this prints its time per layer call beside today's
single SDPA call, for SmolLM2-135M's and Qwen2.5-Coder-1.5B's attention shapes, by key width and tree rows.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hierspec.runtime.exact_attention import ExactPlan, exact_attention

SHAPES = (("SmolLM2-135M", 9, 3, 64), ("Qwen2.5-Coder-1.5B", 12, 2, 128))


def per_call_us(function, repeats: int = 200) -> float:
    for _ in range(20):
        function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name, heads, kv_heads, dim in SHAPES:
        for width, past in ((512, 300), (1024, 900)):
            for rows in (4, 16, 32):
                query = torch.randn(1, heads, rows, dim)
                keys, values = torch.randn(1, kv_heads, width, dim), torch.randn(1, kv_heads, width, dim)
                mask = torch.zeros(rows, width, dtype=torch.bool)
                mask[:, : past + 1] = True
                plan = ExactPlan(mask)
                groups = heads // kv_heads
                additive = torch.zeros(rows, width).masked_fill_(~mask, -torch.inf).repeat(groups, 1)[None, None]
                folded = query.reshape(1, kv_heads, groups * rows, dim)
                exact = per_call_us(lambda: exact_attention(query, keys, values, plan, 0.125))
                today = per_call_us(lambda: F.scaled_dot_product_attention(folded, keys, values, attn_mask=additive,
                                                                           scale=0.125))
                print(f"{name:20s} keys {width:5d} rows {rows:3d}: exact {exact:6.0f} us, SDPA {today:6.0f} us "
                      f"per layer (+{exact - today:.0f} us)")


if __name__ == "__main__":
    main()
