"""Scripted drafters that know the reference output, for exercising every acceptance path."""

from __future__ import annotations

import numpy as np

from hierspec.drafters.base import Drafter
from hierspec.tree import DraftTree, build_tree


class ScriptedDrafter(Drafter):
    """Drafts fully right, partly right and wrong branches from a known reference continuation.

    Each step draws 1–4 branches; each branch is the true future (``right``), the true future with one token
    changed (``partial``) or random tokens (``wrong``); the branches are shuffled so the right one is not always
    first.
    """

    name = "scripted"

    def __init__(self, prompt_len: int, truth: list[int], vocab: int, seed: int) -> None:
        self.prompt_len = prompt_len
        self.truth = list(truth)
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        done = len(context) - self.prompt_len
        future = self.truth[done:done + 8]
        branches = []
        for _ in range(int(self.rng.integers(1, 5))):
            length = int(self.rng.integers(1, 9))
            kind = self.rng.choice(["right", "partial", "wrong"])
            if kind == "wrong" or not future:
                branches.append(self.rng.integers(0, self.vocab, size=length).tolist())
                continue
            branch = list(future[:length])
            if kind == "partial":
                j = int(self.rng.integers(0, len(branch)))
                branch[j] = (branch[j] + 1 + int(self.rng.integers(0, self.vocab - 1))) % self.vocab
            branches.append(branch)
        order = self.rng.permutation(len(branches))
        return build_tree(int(context[-1]), [branches[i] for i in order], budget=budget)


class AdversarialDrafter(Drafter):
    """Random draft trees mixing the most likely, least likely and random tokens under a known distribution.

    ``table(prefix)`` returns the target's probability vector after ``prefix`` (generated tokens only).
    """

    name = "adversarial"

    def __init__(self, prompt_len: int, table, vocab: int, seed: int) -> None:
        self.prompt_len = prompt_len
        self.table = table
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        generated = [int(t) for t in context[self.prompt_len:]]
        branches = []
        for _ in range(int(self.rng.integers(0, 4))):
            prefix, branch = list(generated), []
            for _ in range(int(self.rng.integers(1, 4))):
                probs = self.table(tuple(prefix)) if len(prefix) < 3 else None
                pick = self.rng.integers(0, 3)
                if probs is None or pick == 2:
                    token = int(self.rng.integers(0, self.vocab))
                else:
                    token = int(np.argmax(probs) if pick == 0 else np.argmin(probs))
                branch.append(token)
                prefix.append(token)
            branches.append(branch)
        return build_tree(int(context[-1]), branches, budget=budget)


class TableLM:
    """A fast stand-in for :class:`hierspec.draft_lm.DraftLM`: logits that depend on the last two tokens, drawn
    once per pair from a seeded generator. Losslessness must hold for any draft distribution, so statistical tests
    can use it where a real model's Python overhead would dominate their run time."""

    def __init__(self, vocab: int, seed: int, scale: float = 2.0, step_ms: float = 0.0) -> None:
        import types

        self.vocab, self.seed, self.scale, self.step_ms = vocab, seed, scale, step_ms
        self.model = types.SimpleNamespace(name=f"table-{seed}")
        self._rows: dict = {}
        self.forwards = 0

    def reset(self) -> None:
        self.forwards = 0

    def lacks(self, context) -> int:
        return 0  # no cache: nothing to read before drafting, so it starts at once

    def prefill_ms(self, tokens: int) -> float:
        return 0.0

    def _row(self, tokens):
        import torch

        key = tuple(int(t) for t in tokens[-2:])
        row = self._rows.get(key)
        if row is None:
            generator = torch.Generator().manual_seed(hash((self.seed, key)) % (1 << 31))
            row = self._rows[key] = torch.randn(self.vocab, generator=generator, dtype=torch.float64) * self.scale
        return row

    tokens = None  # a whole head: scores are indexed by token id

    def next_scores(self, context):
        self.forwards += 1
        return self._row(list(context))

    next_logits = next_scores

    def spread(self, scores, fill):
        return scores

    def score_tree(self, context, tree):
        import torch

        self.forwards += 1
        return torch.stack([self._row(list(context) + tree.sequence(node)) for node in range(tree.size)])

    def keep(self, path) -> None:
        pass
