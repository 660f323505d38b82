"""Draft-model drafting with HSDDW's self-verify dynamic window (HSDDW section 3.1, algorithm 1).

A draft model (any causal LM with the target's tokenizer, or the target's own first layers) proposes up to ``K``
tokens one at a time. Under sampling each token is drawn from the draft's warped distribution ``q`` and the chain
carries every ``q``, so the verifier applies speculative sampling (accept with ``min(1, p/q)``, resample from the
residual); at temperature 0 the draft takes the argmax and the greedy rule applies.

*Self-verify*: drafting stops as soon as the entropy of the draft's distribution at the current position exceeds
the confidence threshold ``τ``, the mean entropy of the draft tokens the verifier rejected so far in this generation
(the drafted token at that position is still proposed, as in algorithm 1). The paper starts from ``τ = 0``; the
starting value is configurable because with ``τ = 0`` every window has length one until the first rejection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from hierspec.accept import Verdict, sample_token, warp_probs
from hierspec.config import SamplingConfig
from hierspec.draft_lm import DraftLM
from hierspec.drafters.base import Drafter
from hierspec.drafters.deferred_start import DeferredStart
from hierspec.drafters.registry import register
from hierspec.drafters.token_window import TokenWindow
from hierspec.tree import DraftTree, chain, root_only

DRAFT_SOURCE = "draft"


def entropy(probs: torch.Tensor) -> float:
    """Shannon entropy in nats of a probability vector (zeros count nothing)."""
    return float(torch.special.entr(probs).sum())


class EntropyThreshold:
    """HSDDW's confidence threshold: the mean entropy of the rejected draft tokens seen so far."""

    def __init__(self, initial: float) -> None:
        self.initial = initial
        self.reset()

    def reset(self) -> None:
        """Back to the initial threshold (start of a generation)."""
        self.rejected: list[float] = []

    @property
    def value(self) -> float:
        """The current threshold ``τ``."""
        return sum(self.rejected) / len(self.rejected) if self.rejected else self.initial

    def record_rejection(self, entropy_of_rejected: float) -> None:
        """A draft token whose distribution had this entropy was rejected."""
        self.rejected.append(entropy_of_rejected)

    def confident(self, value: float) -> bool:
        """True while an entropy stays at or under the threshold."""
        return value <= self.value


@dataclass(frozen=True)
class DraftModelConfig:
    """Settings of :class:`DraftModelDrafter`.

    Attributes:
        k: window size ``K``, the most tokens drafted per step.
        self_verify: stop early when the draft's entropy exceeds the threshold ``τ``.
        tau: starting threshold in nats (before any rejection); HSDDW's algorithm starts at 0.
        defer: start the draft model on a long prompt only once the steps without it would pay for reading it
            (:mod:`hierspec.drafters.deferred_start`; with a cost-aware window); ``False``: at once.
    """

    k: int = 4
    self_verify: bool = False
    tau: float = 1.0
    defer: bool = True

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("k must be >= 1")
        if self.tau < 0 or math.isnan(self.tau):
            raise ValueError("tau must be >= 0")


class SampledDraft:
    """Draws draft tokens the way the generation samples: argmax when greedy, else from the warped distribution."""

    def __init__(self) -> None:
        self.sampling = SamplingConfig()
        self.generator = torch.Generator()

    def prepare(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        self.sampling, self.generator = sampling, generator

    def draw(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None, float, float]:
        """A token (an index into ``logits``), the distribution it was drawn from (``None`` when greedy), that
        distribution's entropy and the token's probability in it.

        Greedy drafting has no distribution to verify against; its confidence is read from the plain softmax.
        """
        if self.sampling.greedy:
            probs = torch.softmax(logits.to(torch.float64), dim=-1)
            token = int(probs.argmax())
            return token, None, entropy(probs), float(probs[token])
        q = warp_probs(logits, self.sampling)
        token = sample_token(q, self.generator)
        return token, q, entropy(q), float(q[token])


class DraftModelDrafter(Drafter):
    """Speculative decoding with a draft model (``sd``), optionally with self-verify windows."""

    name = "sd"

    def __init__(self, lm: DraftLM, config: DraftModelConfig | None = None) -> None:
        self.lm = lm
        self.config = config or DraftModelConfig()
        self.threshold = EntropyThreshold(self.config.tau)
        self.sampler = SampledDraft()
        self._entropies: list[float] = []
        self.windows: list[int] = []
        self.window: TokenWindow | None = None
        self.start = DeferredStart(lm, defer=self.config.defer, deepest=self.config.k)

    def prepare(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        self.sampler.prepare(sampling, generator)

    def use_window(self, window: TokenWindow) -> bool:
        self.window = window
        return True

    def begin(self, prompt: np.ndarray) -> None:
        self.lm.reset()
        self.threshold.reset()
        self.start.begin()
        self.windows = []
        self._entropies = []

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        """Up to ``k`` tokens of the draft model; none until it has started on this generation (with a cost-aware
        window: :class:`~hierspec.drafters.deferred_start.DeferredStart`)."""
        most = min(self.config.k, budget)
        self._entropies = []
        if most <= 0 or not self.start.ready_in(context, self.window):
            return root_only(int(context[-1]))
        tokens, dists = [], []
        scores = self.lm.next_scores(context)
        while True:
            index, q, h, confidence = self.sampler.draw(scores)
            tokens.append(index if self.lm.tokens is None else int(self.lm.tokens[index]))
            dists.append(None if q is None else self.lm.spread(q, 0.0))
            self._entropies.append(h)
            if self.window is not None:
                self.window.add(confidence)
            if len(tokens) == most or (self.config.self_verify and not self.threshold.confident(h)):
                break
            if self.window is not None and not self.window.worth_more():
                break
            scores = self.lm.next_scores(np.append(context, tokens))
        self.windows.append(len(tokens))
        stacked = None if dists[0] is None else torch.stack(dists)
        return chain(int(context[-1]), tokens, [DRAFT_SOURCE] * len(tokens), stacked)

    def free_proposal(self, context: np.ndarray, budget: int) -> DraftTree | None:
        """Nothing to offer for free; but the step, decoded without the draft model, counts toward its start (the
        ski rental's clock): counted only when asked to draft, steps the cost-aware plan skipped would never add up
        to a prompt's reading, and a plan that waits to learn the draft's acceptance would wait forever (Qwen2.5-
        Coder-1.5B on a Zen 3, HumanEval: 0 tokens drafted in 12 answers)."""
        self.start.ready_in(context, self.window)
        return None

    def draft_cost(self, tokens: int) -> float:
        return tokens * self.lm.step_ms

    def observe(self, verdict: Verdict, context: np.ndarray) -> None:
        accepted = len(verdict.path)
        if accepted < len(self._entropies):  # the token at position `accepted` was rejected
            self.threshold.record_rejection(self._entropies[accepted])
        self._entropies = []  # they belong to this step's draft (a step with no draft of ours learns nothing)

    def report(self) -> dict:
        return {"windows": list(self.windows), "tau": self.threshold.value, "draft_forwards": self.lm.forwards,
                "deferred_steps": self.start.deferred_steps}

    def describe(self) -> dict:
        return {**super().describe(), "draft_model": self.lm.model.name}


@dataclass(frozen=True)
class SdOptions:
    """``sd`` options: the draft model (``self:K`` or a model) and :class:`DraftModelConfig`'s fields.

    The default draft, 90 % of the target's layers, was the fastest self-drafting depth measured on SmolLM2
    (BENCHMARKS.md); shallower self-drafts are cheaper but almost never accepted.
    """

    draft: str = "self:0.9"
    k: int = 4
    self_verify: bool = False
    tau: float = 1.0
    defer: bool = True


def given_model(written: dict[str, str], key: str, from_cli: str | None, default: str) -> str:
    """A model option: the method's own ``key=`` first, then the command line's flag, then the default."""
    return written.get(key) or from_cli or default


@register("sd", SdOptions, summary="a draft model (--draft-model M or self:K) with speculative sampling")
def build_draft_model(options: SdOptions, written: dict[str, str], context) -> DraftModelDrafter:
    """``sd:draft=self:0.9,k=4,self_verify=false,tau=1.0,defer=true``."""
    draft = given_model(written, "draft", context.draft_model, options.draft)
    config = DraftModelConfig(k=options.k, self_verify=options.self_verify or context.self_verify, tau=options.tau,
                              defer=options.defer)
    return DraftModelDrafter(context.load_draft_lm(draft, "sd"), config)
