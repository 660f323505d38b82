"""Cost-aware drafting: trim any drafter's tree to the depth that maximises expected tokens per millisecond.

The decoder's gain from a draft is the tokens it adds per unit of time. With the target's measured cost curve
``c(K)`` (:mod:`hierspec.calibration`) and, for every depth ``d``, the running rate ``r(d)`` at which steps whose
tree reached depth ``d`` accepted at least ``d`` draft tokens, a tree cut at depth ``D`` is expected to add
``1 + Σ_{d≤D} r(d)`` tokens for ``c(1 + nodes up to depth D)`` ms. :class:`CostAwareDrafter` keeps the depth with
the best ratio — possibly 0, no draft at all, when drafting would cost more than it returns. Rates start from a
prior of one success in two trials, and every ``explore_every``-th step drafts in full so the rates keep learning.
Cutting a tree never changes the output: any tree is verified losslessly.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from hierspec.accept import Verdict
from hierspec.config import SamplingConfig
from hierspec.drafters.base import Drafter
from hierspec.tree import DraftTree


class CostModel(Protocol):
    """What cost-aware drafting reads of a measured cost curve (:class:`hierspec.calibration.CostCurve` is one):
    milliseconds of a verification forward of ``tokens`` tree tokens, and what the curve was measured on."""

    identity: dict

    def cost(self, tokens: int) -> float: ...


_PRIOR_HITS, _PRIOR_TRIALS = 1.0, 2.0


class CostAwareDrafter(Drafter):
    """Wraps a drafter; trims its trees by depth with the cost curve and the observed acceptance per depth."""

    def __init__(self, inner: Drafter, curve: CostModel, explore_every: int = 8) -> None:
        self.inner = inner
        self.curve = curve
        self.explore_every = explore_every
        self.name = f"{inner.name}+cost"
        self._reached = np.zeros(65)  # steps whose verified tree had depth >= d
        self._accepted = np.zeros(65)  # of those, steps that accepted >= d draft tokens
        self._steps = 0
        self._depth = 0
        self.cut_steps = 0

    @property
    def verifier_topk(self) -> int:
        return self.inner.verifier_topk

    @property
    def wants_hidden(self) -> bool:
        return self.inner.wants_hidden

    def observe_hidden(self, hidden: np.ndarray) -> None:
        self.inner.observe_hidden(hidden)

    def prepare(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        self.inner.prepare(sampling, generator)

    def begin(self, prompt: np.ndarray) -> None:
        self.inner.begin(prompt)

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        tree = self.inner.propose(context, budget)
        self._steps += 1
        if tree.size == 1 or self._steps % self.explore_every == 0:
            self._depth = int(tree.depths.max())
            return tree
        depth = self.best_depth(tree)
        if depth < int(tree.depths.max()):
            self.cut_steps += 1
            tree = cut_to_depth(tree, depth)
        self._depth = depth
        return tree

    def best_depth(self, tree: DraftTree) -> int:
        """The cut depth with the most expected tokens per millisecond."""
        deepest = min(int(tree.depths.max()), self._reached.shape[0] - 1)
        nodes_up_to = np.cumsum(np.bincount(tree.depths, minlength=deepest + 1))[: deepest + 1]
        rates = (self._accepted[1 : deepest + 1] + _PRIOR_HITS) / (self._reached[1 : deepest + 1] + _PRIOR_TRIALS)
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(rates)])
        per_ms = [expected[d] / self.curve.cost(int(nodes_up_to[d])) for d in range(deepest + 1)]
        return int(np.argmax(per_ms))

    def observe(self, verdict: Verdict, context: np.ndarray) -> None:
        depth = min(self._depth, self._reached.shape[0] - 1)
        accepted = min(len(verdict.path), depth)
        self._reached[1 : depth + 1] += 1
        self._accepted[1 : accepted + 1] += 1
        self.inner.observe(verdict, context)

    def finish(self, context: np.ndarray) -> None:
        self.inner.finish(context)

    def report(self) -> dict:
        return {**self.inner.report(), "cost_cut_steps": self.cut_steps}

    def describe(self) -> dict:
        return {**self.inner.describe(), "cost_aware": True, "cost_curve": self.curve.identity}


def cut_to_depth(tree: DraftTree, depth: int) -> DraftTree:
    """The tree's nodes up to ``depth`` (a breadth-first prefix, so indices and parents stay valid)."""
    keep = int(np.searchsorted(tree.depths, depth, side="right"))
    return DraftTree(
        tokens=tree.tokens[:keep], parents=tree.parents[:keep], depths=tree.depths[:keep],
        sources=tree.sources[:keep], probs=None if tree.probs is None else tree.probs[:keep],
        dists=None if tree.dists is None else tree.dists[:keep],
    )
