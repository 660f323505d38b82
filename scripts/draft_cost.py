"""Cost of one draft step of self-drafting models (the target's first K layers) against the target's own steps.

    python scripts/draft_cost.py [--model M] [--layers 4,8,16,24,27] [--context 128] [--repeats 15]

Prints the median time of a one-token forward of each self-drafting depth and of the target verifying 1, 2, 4, 8
and 16 tokens on top of a context of ``--context`` tokens: the numbers that decide when a draft model can pay.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from hierspec.draft_lm import self_drafting_model
from hierspec.target import load_model
from hierspec.tree import build_tree


def median_ms(model, context: list[int], tree, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        cache = model.new_cache()
        model.prefill(cache, context[:-1])
        start = time.perf_counter()
        model.forward_tree(cache, tree)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--layers", default="4,8,16,24,27")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.model)
    rng = np.random.default_rng(0)
    context = rng.integers(100, 10_000, size=args.context).tolist()
    root = context[-1]
    total = target.model.config.num_hidden_layers
    print(f"{target.name}: {total} layers, context {args.context} tokens, {args.threads} threads")
    print("| forward | ms |\n|---|---:|")
    for k in (int(x) for x in args.layers.split(",")):
        draft = self_drafting_model(target, k)
        print(f"| draft step, self:{k} | {median_ms(draft, context, build_tree(root, []), args.repeats):.1f} |")
    for width in (1, 2, 4, 8, 16):
        tree = build_tree(root, [rng.integers(100, 10_000, size=width - 1).tolist()] if width > 1 else [])
        print(f"| target, {width} token(s) | {median_ms(target, context, tree, args.repeats):.1f} |")


if __name__ == "__main__":
    main()
