"""What HSDDW's greedy middle round spends around the draft model's forward, before and after the fortieth session.

Usage:
    python scripts/greedy_round_cost.py [--vocab 151936] [--shortlist 32768] [--nodes 6] [--threads 2]

A proposal chain of ``nodes - 1`` tokens whose first three the middle model accepts, scored over a shortlist head:
"whole rows" spreads the shortlist scores over the vocabulary in float64 and takes a softmax over each accepted
node's whole row (the round before); "shortlist" reads the scores as they come
(``HSDDWDrafter._pre_verify_greedy``). Both must reach the same verdict; prints milliseconds a round for each, twice,
alternating.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from hierspec.accept import accept_predicted, row_argmax, verify
from hierspec.config import SamplingConfig
from hierspec.tree import chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--shortlist", type=int, default=32_768)
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(args.vocab, args.shortlist, replace=False)).astype(np.int64)
    tokens = torch.from_numpy(ids)
    scores = torch.randn(args.nodes, args.shortlist)
    best = scores.argmax(-1).numpy()
    tail = [int(t) for t in rng.integers(0, args.vocab, size=args.nodes - 4)]
    tree = chain(1, [int(ids[b]) for b in best[:3]] + tail, ["x"] * (args.nodes - 1), None)
    generator, greedy = torch.Generator(), SamplingConfig()

    def whole_rows():
        whole = scores.new_full((args.nodes, args.vocab), -torch.inf)
        whole[:, tokens] = scores
        logits = whole.to(torch.float64)
        verdict = verify(tree, logits, greedy, generator)
        for node, token in zip((0, *verdict.path), verdict.accepted_tokens):
            probs = torch.softmax(logits[node], dim=-1)
            float(torch.special.entr(probs).sum()), float(probs[token])
        return verdict

    def shortlist():
        found = row_argmax(scores)
        verdict = accept_predicted(tree, ids[found])
        nodes = [0, *verdict.path]
        probs = torch.softmax(scores[nodes].to(torch.float64), dim=-1)
        probs[torch.arange(len(nodes)), torch.from_numpy(found[nodes])].tolist()
        torch.special.entr(probs).sum(dim=-1).tolist()
        return verdict

    assert whole_rows().path == shortlist().path and len(shortlist().path) == 3
    for round_ in (whole_rows, shortlist, whole_rows, shortlist):
        for _ in range(20):
            round_()
        start = time.perf_counter()
        for _ in range(args.repeats):
            round_()
        print(f"{round_.__name__:>10}: {(time.perf_counter() - start) / args.repeats * 1e3:.3f} ms a round")


if __name__ == "__main__":
    main()
