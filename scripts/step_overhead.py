"""How much of a decoding step is spent outside the target's forward pass.

Usage:
    python scripts/step_overhead.py [--methods ar,pld,hd] [--datastore DIR ...] [--threads 2] [--model M]

Answers the first question of each category of the dev set (128 new tokens, greedy) with each method and times
``Runtime.forward_tree`` (the model's forward with its input buffers and bucket padding) inside the decoding loop.
Everything else in the loop after the prefill (drafting, acceptance, cache compaction, drafter bookkeeping) is
reported as "outside the forward", per step and as a share of the step loop.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hierspec
from hierspec.methods import split_methods


def first_question_per_category(path: str) -> list[str]:
    seen: set[str] = set()
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if row["category"] not in seen:
                seen.add(row["category"])
                prompts.append(row["turns"][0])
    return prompts


class ForwardTimer:
    """Wraps a runtime's ``forward_tree`` and adds up the seconds spent in it."""

    def __init__(self, runtime) -> None:
        self.seconds, self.calls = 0.0, 0
        self._forward = runtime.forward_tree
        runtime.forward_tree = self

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._forward(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # a CUDA forward returns before its kernels end
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ar,pld,hd")
    parser.add_argument("--datastore", action="append", default=[])
    parser.add_argument("--questions", default="data/spec_bench_dev.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="anything --model takes (default: the default model)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model = hierspec.load_model(args.model)
    prompts = first_question_per_category(args.questions)
    timer = ForwardTimer(model.runtime)
    for method in split_methods(args.methods):
        hierspec.generate(model, prompts[0], method=method, datastores=args.datastore, max_new_tokens=16)  # warm-up
        timer.reset()
        loop = steps = tokens = 0
        for prompt in prompts:
            stats = hierspec.generate(model, prompt, method=method, datastores=args.datastore,
                                      max_new_tokens=args.max_new_tokens).stats
            loop += stats.total_time - stats.prefill_time
            steps += stats.target_forwards
            tokens += stats.new_tokens
        outside = loop - timer.seconds
        print(f"{method}: {steps} steps, {tokens} tokens; forward {1e3 * timer.seconds / timer.calls:.2f} ms/step, "
              f"outside the forward {1e3 * outside / steps:.2f} ms/step = {100 * outside / loop:.1f}% of the step loop")


if __name__ == "__main__":
    main()
