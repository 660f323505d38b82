"""Where was the target's token when `hd` accepted nothing? A study of the steps that drafted in vain.

    python scripts/miss_study.py --per-category 1 --max-new-tokens 128 --out bench-out/miss-study

Runs greedy `hd` (default settings, whatever stores are found) on dev questions through a drafter that records,
at every step, every candidate each database offers (up to ``--candidates`` per database, beyond what the tree
kept) and the target's top-``--topk`` predictions after the last accepted node of the previous step. For each step
that accepted no draft token (the target's token is the step's bonus token), it asks:

* did the tree hold anything at all (a step with an empty tree drafted nothing: the sizing's choice, not a miss);
* which database held the target's token as the first token of one of its candidates, and at what rank;
* was it deeper in a candidate (the right token one or more positions too late: a source that lags);
* was it among the previous step's top-k predictions for the root's position, rank 2..k (LogitSpec's observation:
  the logits that predicted this step's root often also name the token after it) — as top-1 it would have been
  the root itself.

The drafter's behaviour is unchanged (its own verdicts keep the top-k width it asked for); outputs are checked
against `ar`. Writes ``study.json`` and ``study.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

import hierspec
from hierspec.bench.questions import load_questions, select_questions
from hierspec.config import GenerationConfig, ModelConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.base import Drafter
from hierspec.machine import cpu_info
from hierspec.methods import DrafterContext, make_drafter


class RecordingDrafter(Drafter):
    """Wraps an ``hd`` drafter: proposes what it proposes, and records what its databases held at each step."""

    name = "hd-recorded"

    def __init__(self, inner, candidates: int, topk: int) -> None:
        self.inner, self.limit, self.topk = inner, candidates, topk
        self.verifier_topk = max(inner.verifier_topk, topk)
        self.wants_hidden = inner.wants_hidden
        self.steps: list[dict] = []
        self._pending: dict | None = None
        self._previous_topk: list[int] | None = None

    def prepare(self, sampling, generator) -> None:
        self.inner.prepare(sampling, generator)

    def begin(self, prompt: np.ndarray) -> None:
        self._previous_topk = None
        self.inner.begin(prompt)

    def share_forward(self, rows: int, tokens: float) -> None:
        self.inner.share_forward(rows, tokens)

    def observe_hidden(self, hidden: np.ndarray) -> None:
        self.inner.observe_hidden(hidden)

    def finish(self, context: np.ndarray) -> None:
        self.inner.finish(context)

    def propose(self, context: np.ndarray, budget: int):
        saved = self.inner.config
        self.inner.config = dataclasses.replace(saved, candidates=self.limit)
        try:
            offered = self.inner.candidates(context)
        finally:
            self.inner.config = saved
        tree = self.inner.propose(context, budget)
        self._pending = {"offered": [(c.source, c.tokens) for c in offered], "tree_size": tree.size,
                         "previous_topk": self._previous_topk}
        return tree

    def observe(self, verdict, context: np.ndarray) -> None:
        record = self._pending or {}
        record["accepted"] = len(verdict.path)
        record["target"] = int(verdict.bonus) if not verdict.path else None
        self.steps.append(record)
        last = verdict.path[-1] if verdict.path else 0
        if verdict.target_topk is not None:
            self._previous_topk = [int(t) for t in verdict.target_topk[last]]
        own = self.inner.verifier_topk
        topk = verdict.target_topk[:, :own] if verdict.target_topk is not None and own > 1 else None
        self.inner.observe(dataclasses.replace(verdict, target_topk=topk), context)


def classify(step: dict) -> dict:
    """For a step that accepted nothing: where its target token was."""
    target = step["target"]
    first_rank: dict[str, int] = {}
    deeper: set[str] = set()
    rank_in_source: collections.Counter[str] = collections.Counter()
    for source, tokens in step["offered"]:
        rank = rank_in_source[source]
        rank_in_source[source] += 1
        if tokens and tokens[0] == target:
            first_rank.setdefault(source, rank)
        elif target in tokens[1:]:
            deeper.add(source)
    previous = step["previous_topk"]
    logit_rank = previous.index(target) if previous is not None and target in previous else None
    return {"first_rank": first_rank, "deeper": sorted(deeper), "logit_rank": logit_rank,
            "empty_tree": step["tree_size"] <= 1, "offered": len(step["offered"])}


def summarise(steps: list[dict], topk: int) -> tuple[dict, list[str]]:
    misses = [classify(s) for s in steps if s.get("accepted") == 0 and s.get("target") is not None]
    total = len(steps)
    count = len(misses)
    drafted = [m for m in misses if not m["empty_tree"]]
    sources = sorted({src for m in misses for src in m["first_rank"]} | {src for m in misses for src in m["deeper"]})
    lines = [f"steps {total}; accepted nothing {count} ({count / max(1, total):.1%}); of those the tree was empty "
             f"(nothing drafted) in {count - len(drafted)} and held a wrong draft in {len(drafted)}", "",
             "| where the target's token was (steps that accepted nothing) | all such steps | with a wrong draft |",
             "|---|---:|---:|"]

    def share(rows: list[dict], test) -> str:
        hit = sum(1 for m in rows if test(m))
        return f"{hit} ({hit / max(1, len(rows)):.1%})"

    for source in sources:
        lines.append(f"| `{source}`: first token of its best candidate | "
                     f"{share(misses, lambda m: m['first_rank'].get(source) == 0)} | "
                     f"{share(drafted, lambda m: m['first_rank'].get(source) == 0)} |")
        lines.append(f"| `{source}`: first token of a lower-ranked candidate | "
                     f"{share(misses, lambda m: m['first_rank'].get(source, 0) > 0)} | "
                     f"{share(drafted, lambda m: m['first_rank'].get(source, 0) > 0)} |")
        lines.append(f"| `{source}`: only deeper in a candidate (one or more positions late) | "
                     f"{share(misses, lambda m: source in m['deeper'] and source not in m['first_rank'])} | "
                     f"{share(drafted, lambda m: source in m['deeper'] and source not in m['first_rank'])} |")
    lines.append(f"| any database, first token of any candidate | {share(misses, lambda m: bool(m['first_rank']))} | "
                 f"{share(drafted, lambda m: bool(m['first_rank']))} |")
    lines.append(f"| previous step's target top-{topk}, rank 2..{topk} (LogitSpec) | "
                 f"{share(misses, lambda m: m['logit_rank'] is not None and m['logit_rank'] > 0)} | "
                 f"{share(drafted, lambda m: m['logit_rank'] is not None and m['logit_rank'] > 0)} |")
    lines.append(f"| previous top-{topk} but no database | "
                 f"{share(misses, lambda m: not m['first_rank'] and (m['logit_rank'] or 0) > 0)} | "
                 f"{share(drafted, lambda m: not m['first_rank'] and (m['logit_rank'] or 0) > 0)} |")
    lines.append(f"| nowhere (no database, not in the previous top-{topk}) | "
                 f"{share(misses, lambda m: not m['first_rank'] and not (m['logit_rank'] or 0) > 0)} | "
                 f"{share(drafted, lambda m: not m['first_rank'] and not (m['logit_rank'] or 0) > 0)} |")
    summary = {"steps": total, "accepted_nothing": count, "empty_tree": count - len(drafted), "misses": misses}
    return summary, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", default="data/spec_bench_dev.jsonl")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--candidates", type=int, default=16, help="candidates recorded per database")
    parser.add_argument("--topk", type=int, default=8, help="previous step's target predictions recorded")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--method", default="hd", help="an hd spec, e.g. hd:tree=fixed")
    parser.add_argument("--datastore", action="append", default=[])
    parser.add_argument("--out", default="bench-out/miss-study")
    args = parser.parse_args()

    model = hierspec.load_model(args.model, ModelConfig(dtype=args.dtype))
    context = DrafterContext(model, datastores=args.datastore) if args.datastore else DrafterContext(model)
    inner = make_drafter(args.method, context)
    recorder = RecordingDrafter(inner, args.candidates, args.topk)
    questions = select_questions(load_questions(args.questions), args.per_category, None)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    identical = 0
    start = time.perf_counter()
    for question in questions:
        prompt = model.encode_prompt(question.turns[0], raw=question.raw)
        out = SpeculativeDecoder(model, recorder).generate(prompt, config)
        plain = SpeculativeDecoder(model, NoDrafter()).generate(prompt, config)
        identical += out.token_ids == plain.token_ids
    summary, lines = summarise(recorder.steps, args.topk)
    cpu = cpu_info().describe()
    head = (f"CPU: {cpu}; model {model.name}, runtime {model.runtime.kind}; method `{args.method}` (databases "
            f"{inner.sources}); {len(questions)} dev questions, {args.max_new_tokens} new tokens, greedy; "
            f"{args.candidates} candidates recorded per database; identical to ar {identical}/{len(questions)}; "
            f"{time.perf_counter() - start:.0f} s")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "study.json").write_text(json.dumps({"head": head, "args": vars(args), **summary}, indent=1))
    (out_dir / "study.md").write_text("\n".join([head, "", *lines]) + "\n")
    print("\n".join([head, "", *lines]))


if __name__ == "__main__":
    main()
