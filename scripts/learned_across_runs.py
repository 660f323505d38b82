"""What a one-shot run (a new process per question, as ``hierspec generate`` is) gains from starting where the last
run's drafter stopped.

Usage:
    python scripts/learned_across_runs.py [--method hd] [--per-category 2] [--max-new-tokens 128] [--threads 2]

Each question is answered three times, interleaved: plain decoding; ``--method`` with a drafter made from a fresh
:class:`~hierspec.methods.DrafterContext` without a learned-state directory (a new process: the priors); and with a
fresh context that reads and writes a learned-state file in a temporary directory (a new process under
``hierspec generate --keep-learned``, the default), so it starts from what the earlier questions taught. Prints
tokens/s, each method's ratio to plain decoding, the mean accepted length and whether every output is identical.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import hierspec
from hierspec.bench.questions import load_questions, select_questions
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.methods import DrafterContext, make_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="hd")
    parser.add_argument("--questions", default="data/spec_bench_dev.jsonl")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = hierspec.load_model()
    config = hierspec.make_config(max_new_tokens=args.max_new_tokens)
    learned_dir = tempfile.mkdtemp(prefix="hierspec-learned-")
    arms = {"ar": None, f"{args.method} (priors)": None, f"{args.method} (learned file)": learned_dir}
    totals = {arm: [0, 0.0, 0, 0] for arm in arms}  # tokens, seconds, forwards, identical
    prompts = select_questions(load_questions(args.questions), args.per_category)
    first = prompts[0]
    SpeculativeDecoder(model, NoDrafter()).generate(model.encode_prompt(first.turns[0], raw=first.raw), config)
    for question in prompts:  # first turns, as the bench reads them
        ids = model.encode_prompt(question.turns[0], raw=question.raw)
        reference = None
        for arm, directory in arms.items():
            drafter = NoDrafter() if arm == "ar" else make_drafter(
                args.method, DrafterContext(model, learned_dir=directory))
            start = time.perf_counter()
            result = SpeculativeDecoder(model, drafter).generate(ids, config)
            seconds = time.perf_counter() - start
            reference = result.token_ids if reference is None else reference
            total = totals[arm]
            total[0] += len(result.token_ids)
            total[1] += seconds
            total[2] += result.stats.target_forwards
            total[3] += result.token_ids == reference
    base = totals["ar"][0] / totals["ar"][1]
    for arm, (tokens, seconds, forwards, same) in totals.items():
        speed = tokens / seconds
        print(f"{arm:24s} {speed:8.2f} tokens/s  {speed / base:.3f}x ar  MAT {tokens / max(forwards, 1):.2f}  "
              f"identical {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
