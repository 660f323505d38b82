"""The one interface every draft source implements."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import numpy as np
import torch

from hierspec.accept import Verdict
from hierspec.config import SamplingConfig
from hierspec.drafters.carried import CarriedState
from hierspec.drafters.registry import register
from hierspec.tree import DraftTree, root_only


class Drafter(ABC):
    """A source of draft trees.

    The decoding loop calls :meth:`begin` once per generation, then for every step :meth:`propose` (draft a tree for
    the current context) and :meth:`observe` (learn from the target's verdict), and :meth:`finish` at the end. ``context`` is always the whole token
    sequence so far — prompt and generated tokens — whose last token is the tree's root.
    """

    name: str = "drafter"
    #: where what this drafter learned is left when a generation ends, for the next drafter of its method (set by
    #: :func:`~hierspec.methods.make_drafter`; ``None``: kept by nobody)
    carried: CarriedState | None = None
    #: how many of the target's top predictions per tree node the drafter wants in each verdict (1 = argmax only)
    verifier_topk: int = 1
    #: whether the loop should hand the target's last hidden states to :meth:`observe_hidden` (dense retrieval)
    wants_hidden: bool = False

    def prepare(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        """Called before :meth:`begin` with the generation's sampling settings and random source (drafters that
        sample their drafts, such as draft models, use them)."""

    def begin(self, prompt: np.ndarray) -> None:
        """Reset per-generation state; ``prompt`` holds the prompt's token ids."""

    @abstractmethod
    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        """Draft a tree rooted at ``context[-1]`` with at most ``budget`` draft tokens (root excluded)."""

    def draft_cost(self, tokens: int) -> float:
        """Milliseconds this drafter spends to draft a chain of ``tokens`` tokens beyond its bookkeeping: the draft
        models' forwards (from their measured cost curves). Retrieval is taken as free (0, the default)."""
        return 0.0

    def free_proposal(self, context: np.ndarray, budget: int) -> DraftTree | None:
        """Instead of :meth:`propose`, in a step where the cost-aware plan finds that drafting at
        :meth:`draft_cost` does not pay: a draft that costs nothing beyond retrieval (HSDDW's retrieval first
        level, sent to the target without its middle model), or ``None`` (the default) to decode the step plainly."""
        return None

    #: whether the cost-aware wrapper may gate this drafter's search, when drafting is free (retrieval), by its
    #: measured milliseconds against the target steps its accepted tokens save
    #: (:class:`~hierspec.drafters.source_gate.SourceGate`)
    gated_search: bool = True

    @property
    def proposed_free(self) -> bool:
        """Whether the tree :meth:`propose` last returned is a free proposal rather than a draft at
        :meth:`draft_cost` (HSDDW's retrieval level sent alone while its middle model waits to start): the cost-aware
        wrapper then cuts it and learns from its verdict as from a :meth:`free_proposal`'s. ``False`` by default."""
        return False

    def share_forward(self, rows: int, tokens: float, draft_ms: float = 0.0) -> None:
        """Called before :meth:`propose` when other generations' trees are verified in the same forward (batched
        serving): they hold ``rows`` rows, are expected to add ``tokens`` tokens and took ``draft_ms`` milliseconds
        to draft. Drafters that size their trees by cost then maximise the tokens per millisecond of the whole
        step; alone, ``(0, 0, 0)``."""

    def use_window(self, window) -> bool:
        """Offered once by the cost-aware wrapper: a drafter that drafts token by token (a draft model, HSDDW's
        middle model) keeps the :class:`~hierspec.drafters.token_window.TokenWindow`, reports each drafted token's
        confidence to it and drafts further only while it says so; returns whether it does (not by default)."""
        return False

    def observe(self, verdict: Verdict, context: np.ndarray) -> None:
        """Learn from a verification result; ``context`` already includes the accepted and bonus tokens."""

    def observe_hidden(self, hidden: np.ndarray) -> None:
        """Called when :attr:`wants_hidden` is set, after the prefill and after every :meth:`observe`, with the
        target's last hidden state (before the LM head, float32) at the position just before the context's last
        token: the state whose prediction that token is. It comes from forwards that ran anyway."""

    def finish(self, context: np.ndarray) -> None:
        """Called once when a generation ends (finished, stopped or cancelled) with its whole context: prompt and
        generated tokens. Drafters that learn across generations persist what they learned here."""

    def learned(self) -> object | None:
        """What this drafter learned from verdicts that a later generation of the same method may start from
        (:mod:`~hierspec.drafters.carried`; copied before it is kept), or ``None`` (the default) when it learns
        nothing of the kind."""
        return None

    def resume(self, learned: object) -> None:
        """Start from ``learned``, what an earlier drafter of the same method left (its :meth:`learned`, a copy of
        its own); called before the first generation. Nothing by default."""

    def report(self) -> dict:
        """The drafter's own counters for the generation that just ended (empty by default)."""
        return {}

    def problems(self) -> list[str]:
        """Conditions that degrade this drafter without failing generations (a learning store that cannot be
        written…), one line each; the server's ``/health`` reports them. None by default."""
        return []

    def describe(self) -> dict:
        """Settings and data sources, recorded with benchmark results."""
        config = getattr(self, "config", None)
        return {"name": self.name, **({"config": dataclasses.asdict(config)} if dataclasses.is_dataclass(config) else {})}


class NoDrafter(Drafter):
    """Plain autoregressive decoding: the empty draft, so each target forward yields exactly one token."""

    name = "ar"

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        return root_only(int(context[-1]))


@register("ar", summary="plain decoding: no draft, one token per forward", sizes_itself=True)
def build_plain(options, written: dict[str, str], context) -> Drafter:
    """``ar``: the empty draft."""
    return NoDrafter()
