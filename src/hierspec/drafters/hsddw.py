"""HSDDW: hierarchical speculative decoding with dynamic windows (HSDDW section 3.2, algorithm 2).

Three levels. A fast first drafter ``M1`` (a draft model with self-verify, or any drafter: prompt lookup, REST, HD)
proposes; a stronger middle model ``M2`` *pre-verifies* the proposal and adds its own token after the accepted
part; while ``M2`` stays confident (the entropy of its distribution at every position it just decided stays under
its threshold ``τ2``) control returns to ``M1`` for more; when ``M2`` loses confidence, or the budget is used up,
the whole block goes to the target, which verifies it in one forward.

Why the block is exactly an ``M2`` sample, so that the target's verification is lossless:

* ``M2`` verifies ``M1``'s proposal with the same rules the target uses (:func:`hierspec.accept.verify`): speculative
  sampling against ``M1``'s ``q`` for a sampled chain, the deterministic-draft rule (draw ``x ~ p2``, descend if a
  child carries ``x``) for retrieval trees. Both emit tokens each distributed exactly as ``p2`` given the tokens
  before it — the accepted draft tokens and then ``M2``'s own token (the residual draw on a rejection, a plain draw
  from ``p2`` when everything passed).
* So every block token ``b_i`` is distributed as ``p2(· | context, b_<i)``, and the block carries those ``p2`` rows
  as its draft distributions ``q``. Whether the block continues or stops after ``b_i`` is decided from tokens
  already drawn (entropies of ``p2`` up to that position, the budget), never from a token not yet verified, so the
  target's speculative sampling with ``q = p2`` keeps exactly the target's distribution (Leviathan et al., theorem
  1, applied position by position).
* The paper's pseudo-code adds ``M2``'s resampled token to the context but counts only the ``n`` accepted tokens in
  ``n_tot``, so that token would skip the target's verification; here every block token reaches the target.

At temperature 0 the same structure runs with argmax rules, and the output is the target's greedy output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hierspec.accept import Verdict, accept_predicted, row_argmax, verify, warp_probs
from hierspec.config import SamplingConfig
from hierspec.draft_lm import DraftLM
from hierspec.drafters.base import Drafter
from hierspec.drafters.cost_aware import CostAwareDrafter
from hierspec.drafters.deferred_start import DeferredStart
from hierspec.drafters.draft_model import (
    DraftModelConfig,
    DraftModelDrafter,
    EntropyThreshold,
    entropy,
    given_model,
)
from hierspec.drafters.registry import build_drafter, register
from hierspec.drafters.token_window import TokenWindow
from hierspec.errors import InputError
from hierspec.tree import DraftTree, chain, root_only

MIDDLE_SOURCE = "middle"


@dataclass(frozen=True)
class HSDDWConfig:
    """Settings of :class:`HSDDWDrafter`.

    Attributes:
        tau: the middle model's starting confidence threshold in nats (before any target rejection).
        max_block: most tokens in one block sent to the target (the generation's draft budget also caps it).
        defer: start the middle model on a long prompt only once the steps without it would pay for reading it
            (:mod:`hierspec.drafters.deferred_start`; with a cost-aware window); ``False``: at once.
    """

    tau: float = 1.0
    max_block: int = 16
    defer: bool = True

    def __post_init__(self) -> None:
        if self.max_block < 1:
            raise ValueError("max_block must be >= 1")
        if not self.tau >= 0:
            raise ValueError("tau must be >= 0")


class HSDDWDrafter(Drafter):
    """First drafter → middle model (pre-verify + self-verify) → target."""

    name = "hsddw"

    def __init__(self, first: Drafter, middle: DraftLM, config: HSDDWConfig | None = None) -> None:
        self.first = first
        self.middle = middle
        self.config = config or HSDDWConfig()
        self.threshold = EntropyThreshold(self.config.tau)
        self._sampling = SamplingConfig()
        self._generator = torch.Generator()
        self._entropies: list[float] = []
        self.window: TokenWindow | None = None
        # the rent capped at the best case of a middle model drafting up to a block by itself: where that is
        # small (a Zen 1's steep curves: ~1.3x) a round's several first-level tokens do not repay its prompt reading
        self.start = DeferredStart(middle, defer=self.config.defer, deepest=self.config.max_block)
        self._alone = False  # this step's proposal is the first drafter's own, sent without the middle model
        self._reset_counts()

    def use_window(self, window: TokenWindow) -> bool:
        self.window = window
        return True

    def _reset_counts(self) -> None:
        self.counts = {"first_drafted": 0, "first_accepted": 0, "middle_tokens": 0, "rounds": 0}
        self.windows: list[int] = []

    @property
    def verifier_topk(self) -> int:
        return self.first.verifier_topk

    @property
    def wants_hidden(self) -> bool:
        return self.first.wants_hidden

    def observe_hidden(self, hidden: np.ndarray) -> None:
        self.first.observe_hidden(hidden)

    def prepare(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        self._sampling, self._generator = sampling, generator
        self.first.prepare(sampling, generator)

    def begin(self, prompt: np.ndarray) -> None:
        self.first.begin(prompt)
        self.middle.reset()
        self.start.begin()
        self.threshold.reset()
        self._reset_counts()

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        """A block of M2-distributed tokens; until the middle model has started on this generation (with a
        cost-aware window: :class:`~hierspec.drafters.deferred_start.DeferredStart`), the first drafter's own
        proposal when it is free to draft (retrieval), else none."""
        limit = min(budget, self.config.max_block)
        self._entropies = []
        self._alone = False
        if limit <= 0:
            return root_only(int(context[-1]))
        if not self.start.ready_in(context, self.window):
            free = self._first_alone(context, budget)  # a first draft model waits for the middle one
            return root_only(int(context[-1])) if free is None else free
        tokens: list[int] = []
        sources: list[str] = []
        dists: list[torch.Tensor] = []
        confident = True
        while confident and len(tokens) < limit:
            current = np.append(context, tokens).astype(np.int64)
            proposal = self.first.propose(current, limit - len(tokens) - 1)  # room for M2's own token
            verdict, rows = self._pre_verify(current, proposal)
            self.first.observe(verdict, np.append(current, verdict.accepted_tokens).astype(np.int64))
            round_sources = [*(proposal.sources[i] for i in verdict.path), MIDDLE_SOURCE]
            for token, source, (h, chance, row) in zip(verdict.accepted_tokens, round_sources, rows):
                tokens.append(token)
                sources.append(source)
                dists.append(row)
                self._entropies.append(h)
                confident = confident and self.threshold.confident(h)
                if self.window is not None:
                    self.window.add(chance)
            if confident and self.window is not None and len(tokens) < limit:
                confident = self.window.worth_more()  # HSDDW's stop and the tokens-per-millisecond rule together
            self.counts["rounds"] += 1
            self.counts["first_drafted"] += proposal.num_drafted
            self.counts["first_accepted"] += len(verdict.path)
            self.counts["middle_tokens"] += 1
        del tokens[limit:], sources[limit:], dists[limit:], self._entropies[limit:]
        self.windows.append(len(tokens))
        stacked = None if self._sampling.greedy else torch.stack(dists)
        return chain(int(context[-1]), tokens, sources, stacked)

    def free_proposal(self, context: np.ndarray, budget: int) -> DraftTree | None:
        """The first drafter's own proposal when it is free to draft (retrieval), sent to the target as it is (a
        first draft model offers nothing: it starts with the middle one): before the middle model has started, and
        in a step where the plan prices a middle round out — the databases' tree still costs nothing to offer (on
        dev summarization prompts of 660-920 tokens ``hd:draft=on`` decoded up to 48 of 61 steps plainly where
        ``hd`` drafted). The step, taken without the middle model, counts toward its start (see
        :meth:`DraftModelDrafter.free_proposal <hierspec.drafters.draft_model.DraftModelDrafter.free_proposal>`)."""
        self.start.ready_in(context, self.window)
        return self._first_alone(context, budget)

    def _first_alone(self, context: np.ndarray, budget: int) -> DraftTree | None:
        """The first drafter's proposal without the middle model, when it is free to draft; else ``None``."""
        limit = min(budget, self.config.max_block)
        self._entropies = []
        self._alone = limit > 0 and self.first.draft_cost(1) == 0
        return self.first.propose(context, limit) if self._alone else None

    @property
    def proposed_free(self) -> bool:
        """Whether this step's tree is the first drafter's own (the cost-aware wrapper cuts it as a free
        proposal: before this, prompt lookup's up to 16-token trees went to Qwen2.5-Coder-1.5B uncut while the
        middle model waited to start)."""
        return self._alone

    def draft_cost(self, tokens: int) -> float:
        """At most one middle-model round per block token (fewer when the first drafter's tokens pass), plus what
        the first drafter spends."""
        return tokens * self.middle.step_ms + self.first.draft_cost(tokens)

    def _pre_verify(self, context: np.ndarray, proposal: DraftTree) -> tuple[Verdict, list[tuple]]:
        """M2 verifies M1's proposal with the target's rules. Returns its verdict and, for each token it accepted
        and then its own, ``(entropy, probability of the token, distribution)`` of M2 at the node before it —
        the token after node ``i`` is distributed as M2's (warped) distribution there; the distribution is kept
        for sampling only (``None`` when greedy)."""
        if self._sampling.greedy:
            return self._pre_verify_greedy(context, proposal)
        logits = self.middle.score_tree(context, proposal).to(torch.float64)
        verdict = verify(proposal, logits, self._sampling, self._generator)
        self.middle.keep(verdict.path)
        rows = []
        for node, token in zip((0, *verdict.path), verdict.accepted_tokens):
            row = warp_probs(logits[node], self._sampling)
            rows.append((entropy(row), float(row[token]), row))
        return verdict, rows

    def _pre_verify_greedy(self, context: np.ndarray, proposal: DraftTree) -> tuple[Verdict, list[tuple]]:
        """:meth:`_pre_verify` at temperature 0 on M2's shortlist scores as they come: the argmax is the same token,
        and tokens outside the shortlist carry no probability either way. Whole-vocabulary float64 rows for every
        node took 4.3-10.7 ms a round with Qwen2.5-Coder-0.5B's 151,936 tokens (~30 ms), this 0.7-0.9 ms
        (``scripts/greedy_round_cost.py``)."""
        scores = self.middle.score_tree_short(context, proposal)
        best = row_argmax(scores)
        verdict = accept_predicted(proposal, self.middle.token_ids(best))
        self.middle.keep(verdict.path)
        nodes = [0, *verdict.path]
        probs = torch.softmax(scores[nodes].to(torch.float64), dim=-1)
        chances = probs[torch.arange(len(nodes)), torch.from_numpy(best[nodes])].tolist()
        entropies = torch.special.entr(probs).sum(dim=-1).tolist()
        return verdict, [(h, chance, None) for h, chance in zip(entropies, chances)]

    def observe(self, verdict: Verdict, context: np.ndarray) -> None:
        if self._alone:  # the target judged the first drafter's own proposal
            self.first.observe(verdict, context)
            return
        accepted = len(verdict.path)
        if accepted < len(self._entropies):
            self.threshold.record_rejection(self._entropies[accepted])
        self._entropies = []  # they belong to this step's block (a step with no block of ours learns nothing)

    def finish(self, context: np.ndarray) -> None:
        self.first.finish(context)

    def learned(self) -> object | None:
        return self.first.learned()  # the middle model's threshold starts again every generation (begin)

    def resume(self, learned: object) -> None:
        self.first.resume(learned)

    def report(self) -> dict:
        first = self.first.report()
        return {**self.counts, "windows": list(self.windows), "tau_middle": self.threshold.value,
                "middle_forwards": self.middle.forwards, "deferred_steps": self.start.deferred_steps,
                **({"first": first} if first else {})}

    def describe(self) -> dict:
        return {**super().describe(), "first": self.first.describe(), "middle_model": self.middle.model.name}


def pre_verified(first: Drafter, middle: DraftLM, cost: Callable[[int], float], defer: bool = True) -> Drafter:
    """``first``'s drafts pre-verified and continued by the draft model ``middle`` (HSDDW's middle level with its
    default threshold and block), the blocks sized by the cost curves — ``cost``, the target's milliseconds by
    verified rows, and the draft model's own — as every draft model's are
    (:class:`~hierspec.drafters.cost_aware.CostAwareDrafter`): ``hd`` with a draft model."""
    return CostAwareDrafter(HSDDWDrafter(first, middle, HSDDWConfig(defer=defer)), cost)


@dataclass(frozen=True)
class HsddwOptions:
    """``hsddw`` options: the first drafter (``sd`` = a draft model, or a retrieval method name), the two models,
    the first drafter's window and threshold, the middle model's threshold and block size, and whether the middle
    model's start waits until it pays for reading the prompt (``defer``).

    Defaults (BENCHMARKS.md): prompt lookup first (free to run) and 90 % of the target's layers as the middle model.
    ``--draft-model`` alone makes that draft model the middle level under prompt lookup (the paper's three levels;
    the fastest setting measured with Qwen2.5-Coder 0.5B for 1.5B); with ``--middle-model`` too, or ``first=sd``, the
    draft model is the first level instead (by default two thirds of the target's layers).
    """

    first: str = "pld"
    draft: str = "self:0.67"
    middle: str = "self:0.9"
    k: int = 4
    tau1: float = 1.0
    tau: float = 1.0
    max_block: int = 16
    defer: bool = True


#: first drafters hsddw takes besides a draft model
FIRST_DRAFTERS = ("pld", "rest", "hd", "dense")


@register("hsddw", HsddwOptions, summary="HSDDW: a first drafter, a pre-verifying middle model, then the target")
def build_hsddw(options: HsddwOptions, written: dict[str, str], context) -> HSDDWDrafter:
    """``hsddw:first=pld,middle=self:0.9,...``; ``--draft-model`` alone is the middle model, with ``--middle-model``
    the first level."""
    middle_named = bool(written.get("middle") or context.middle_model)
    draft_as_middle = bool(context.draft_model) and not middle_named and "first" not in written
    first_name = options.first if "first" in written or draft_as_middle or not context.draft_model else "sd"
    if first_name == "sd":
        draft = given_model(written, "draft", context.draft_model, options.draft)
        first = DraftModelDrafter(context.load_draft_lm(draft, "hsddw"),
                                  DraftModelConfig(k=options.k, self_verify=True, tau=options.tau1))
    elif first_name in FIRST_DRAFTERS:
        # the middle model sizes the blocks; hd's own draft model stays off under this one
        first = build_drafter("hd:draft=off" if first_name == "hd" else first_name, context, cost_aware=False)
    else:
        raise InputError(f"hsddw's first drafter must be sd or a retrieval method (pld, rest, hd), not "
                         f"{first_name!r}")
    middle_spec = context.draft_model if draft_as_middle else given_model(written, "middle", context.middle_model,
                                                                          options.middle)
    middle = context.load_draft_lm(middle_spec, "hsddw")
    return HSDDWDrafter(first, middle, HSDDWConfig(tau=options.tau, max_block=options.max_block,
                                                   defer=options.defer))
