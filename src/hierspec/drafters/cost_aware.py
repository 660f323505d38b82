"""Cost-aware drafting: draft only as deep as it pays, down to not drafting at all.

The decoder's gain from a draft is the tokens it adds per unit of time. With the target's measured cost curve
``c(K)`` (:mod:`hierspec.calibration`), the drafter's own cost ``δ(D)`` of drafting ``D`` tokens (the draft model's
forwards; nothing for retrieval) and, for every depth ``d``, the running rate ``r(d)`` at which steps whose tree
reached depth ``d`` accepted at least ``d`` draft tokens, a draft of depth ``D`` is expected to add
``1 + Σ_{d≤D} r(d)`` tokens for ``δ(D) + c(nodes up to D)`` ms. :class:`CostAwareDrafter`, the default wrapper of
every method that does not size its own trees:

* for a drafter that pays per drafted token, plans the depth before drafting (tree widths estimated from the trees
  seen so far) and does not call the drafter at all when the plan is 0 — a draft model that cannot pay never runs;
  a retrieval drafter (free to draft) searches every step instead, and only the tree it found is priced (a plan is an
  expectation over the steps that find nothing too: on a Zen 1 it skipped ~20 % of prompt lookup's steps);
* cuts the proposed tree to the depth with the most expected tokens per millisecond (drafting is spent by then);
* lets a drafter that drafts token by token (a draft model, HSDDW's middle model) decide its own length with a
  :class:`~hierspec.drafters.token_window.TokenWindow` instead, the same rule read with each token's confidence;
* explores one level deeper than planned every ``explore_every``-th step, with the drafter's first choice at that
  level and only as many more as cost :data:`PROBE_SHARE` of a step (:func:`probe_level`; REST's whole level of ~3.7
  nodes cost ~1.1 steps on a Zen 1), backing off (the interval doubles up to ``max_explore_every``) while exploring
  finds nothing, so the rates keep learning at a bounded cost;
* never drafts with a drafter that could not beat plain decoding by :data:`MIN_CEILING` even if :data:`FLOOR_ACCEPTANCE`
  of its tokens were accepted, a good draft model's rate (a self-draft of 90 % of the target's layers on a CPU, say),
  and says so once;
* asks a retrieval drafter (no draft cost, no draft distributions) to search only while the target steps its
  accepted tokens save, less what the rows verifying its trees add to the forward, outweigh its search's own
  milliseconds, else every few steps, backing off up to 32
  (:class:`~hierspec.drafters.source_gate.SourceGate`, as ``hd`` gates each of its databases): on SmolLM2's ~6 ms
  integer-product steps REST's ShareGPT search (~0.2 ms a step, MAT 1.01) and a dense store's (~0.8 ms, MAT 1.08)
  cost more than they saved. Counting the rows (since the seventy-fourth session) took SmolLM2's `rest` from
  0.946x / 0.955x `ar` to 0.971x / 0.981x on 65 dev questions (two runs, both rules side by side): the steps its
  tokens saved had paid for the search but not for the rows of its rejected trees. Qwen2.5-Coder-1.5B's `rest`,
  whose curve prices a drafted row above what the decoding loop pays, went from 1.031x / 1.039x to 1.011x / 1.004x;
  so a drafted row is now charged what the loop was seen to pay for one (:class:`LoopRowCost`; the curve's figure
  until eight steps of each kind were timed): SmolLM2 0.981x → 0.997x, the 1.5B 1.025x → 1.034x (one run each).
  Prompt lookup's search is not gated (``Drafter.gated_search``): it reads only the context, and its hits come in
  runs whose starts a gate misses.

Rates start from a prior of one success in two trials at depth 1 and, deeper, from the continuation the shallower
depths show; they decay (:data:`DECAY` per step) so that they follow the text, and a new generation keeps
:data:`CARRIED` of them. Decisions read only the curves and the verdicts, never a clock, so a seeded sampled generation is
reproducible. The search gate reads a clock, but only for drafters without draft distributions, whose sampled
tokens are one draw from the target's distribution each whatever the tree (:func:`~hierspec.accept.accept_sampled`),
so a seeded sampled generation stays reproducible there too. Cutting or skipping a draft never changes the output:
any tree is verified losslessly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from hierspec.accept import Verdict
from hierspec.config import SamplingConfig
from hierspec.drafters.base import Drafter
from hierspec.drafters.exploration import MOST_STEPS_BETWEEN, ExplorationBackOff
from hierspec.drafters.scored import ContextCost
from hierspec.drafters.source_gate import SourceGate
from hierspec.drafters.token_window import TokenWindow, best_case_speedup
from hierspec.tree import DraftTree, root_only

log = logging.getLogger(__name__)

_PRIOR_HITS, _PRIOR_TRIALS = 1.0, 2.0
#: weight of the prior "a chain that reaches every depth asked" in the tree-shape estimates
_PRIOR_SHAPE = 1.0
#: deepest depth whose acceptance rate is tracked
MAX_DEPTH = 64
#: each step multiplies the acceptance counts by this: the rates follow roughly the last few hundred steps
DECAY = 0.995
#: weight kept, at the start of a generation, of the acceptance counts earlier generations left
CARRIED = 0.25
#: a drafter whose best case, :data:`FLOOR_ACCEPTANCE` of its tokens accepted, gains less than this over plain
#: decoding never drafts
MIN_CEILING = 1.05
#: the acceptance the floor grants a drafter: a good draft model's (Qwen2.5-Coder-0.5B for the 1.5B: 75 % of its
#: tokens on HumanEval). With every token accepted SmolLM2's 90 %-layer self-draft (~0.73-0.86 of a step a token)
#: passed at 1.06-1.22x, drafted, and lost 5-14 % to plain decoding; at 0.8 it needs a draft token below ~0.68
#: of a target step (Qwen2.5-Coder's pair: ~0.3, 1.5x)
FLOOR_ACCEPTANCE = 0.8
#: an exploration verifies its level's first choice and, after it, only the nodes whose rows together cost at most
#: this share of a one-token step
PROBE_SHARE = 0.25
#: weight of the newest step in the loop's observed row cost (:class:`LoopRowCost`)
LOOP_DECAY = 0.05
#: steps of each kind (the root alone, more rows) before the observed row cost replaces the curve's
LOOP_WARMUP = 8


class CostAwareDrafter(Drafter):
    """Wraps a drafter; plans, skips and cuts its drafts with the cost curves and the observed acceptance.

    Args:
        inner: the drafter wrapped.
        cost: milliseconds of a verification forward of ``rows`` tree nodes (root included).
        explore_every: steps between explorations one level deeper than planned.
        max_explore_every: the longest interval the back-off reaches while explorations find nothing.
    """

    def __init__(self, inner: Drafter, cost: Callable[[int], float], explore_every: int = 8,
                 max_explore_every: int = MOST_STEPS_BETWEEN) -> None:
        if explore_every < 1 or max_explore_every < explore_every:
            raise ValueError("explore_every must be >= 1 and <= max_explore_every")
        self.inner = inner
        # a fixed curve read at up to ~budget row counts in every step: each count is looked up once (per context
        # step, where the curve grows with the context)
        self._curve = ContextCost.of(cost)
        self._cost_now: Callable[[int], float] = self._curve
        self._backoff = ExplorationBackOff(explore_every, max_explore_every)
        self.name = f"{inner.name}+cost"
        self._reached = np.zeros(MAX_DEPTH + 1)  # steps whose verified tree had depth >= d
        self._accepted = np.zeros(MAX_DEPTH + 1)  # of those, steps that accepted >= d draft tokens
        # the same counts over the drafter's free proposals (steps the plan priced out), which cut them
        self._free_reached = np.zeros(MAX_DEPTH + 1)
        self._free_accepted = np.zeros(MAX_DEPTH + 1)
        self._free = False  # this step's tree is a free proposal
        # decayed counts over proposals: asked to draft at least d deep, trees reaching depth d, nodes at depth d
        self._asked = np.zeros(MAX_DEPTH + 1)
        self._deep = np.zeros(MAX_DEPTH + 1)
        self._nodes = np.zeros(MAX_DEPTH + 1)
        self._next_explore = explore_every
        self._steps = 0
        self._depth = 0
        self._planned = 0
        self._exploring = False
        self._proposed = False
        self._ceiling: float | None = None
        self._draft_ms: np.ndarray | None = None  # draft_cost(d) for d = 0..MAX_DEPTH (fixed within a process)
        self._row_ms = _RowCosts()
        self._shared = (0, 0.0)  # other generations' rows and expected tokens in the same forward
        # the last plan and what it read: a run of priced-out steps changes no count, and its plans (~70-120 us
        # each on a Zen 1, ~1 % of SmolLM2's step) are the same until the context reaches the curve's next step
        self._counts_version = 0
        self._last_plan: tuple[tuple, int] | None = None
        self.cut_steps = 0
        self.skipped_steps = 0
        window = TokenWindow(self.cost, inner.draft_cost)
        self.window = window if inner.use_window(window) else None
        # a retrieval drafter (free to draft, no window) searches every step and its found tree is cut
        self._retrieval = self.window is None and inner.draft_cost(1) == 0
        #: whether a step searches at all, for a retrieval drafter (``None`` for drafters that pay per token)
        self.search_gate = SourceGate([inner.name]) if self._retrieval and inner.gated_search else None
        self._search_ms: float | None = None  # the step's search, until its verdict is accounted
        self._search_rows = 1  # the rows the step's found tree was verified in (root included)
        self._loop = LoopRowCost()  # what a drafted row costs the decoding loop, for the search gate
        self.gated_steps = 0

    def cost(self, rows: int) -> float:
        """Milliseconds of verifying ``rows`` tree nodes over the context of the step being drafted."""
        return self._cost_now(rows)

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
        """A new generation: what earlier ones taught about acceptance is kept at :data:`CARRIED` of its weight (a
        new text may suit the drafter better or worse, and depths the plan stopped trying would keep a stale rate)."""
        self.cut_steps = self.skipped_steps = self.gated_steps = 0
        self._search_ms = None
        self._loop.forget_pending()  # a proposal the last generation left unanswered would time the prompt's reading
        if self.search_gate is not None:
            self.search_gate.begin()  # the generation's first search is not counted
        for counts in (self._reached, self._accepted, self._free_reached, self._free_accepted):
            counts *= CARRIED
        self._counts_version += 1
        if self.window is not None:
            self.window.rates.keep(CARRIED)
            self.window.stops = 0
        self.inner.begin(prompt)

    def draft_cost(self, tokens: int) -> float:
        return self.inner.draft_cost(tokens)

    def share_forward(self, rows: int, tokens: float, draft_ms: float = 0.0) -> None:
        self._shared = (int(rows), float(tokens))
        self.inner.share_forward(rows, tokens, draft_ms)

    # ----------------------------------------------------------------- the plan
    def rates(self, deepest: int) -> np.ndarray:
        """Estimated chance of accepting at least ``d`` draft tokens given a draft that deep, ``d = 1..deepest``;
        never higher at a depth than at the one above it (:func:`depth_rates` of the planned drafts' counts)."""
        return depth_rates(self._accepted, self._reached, deepest)

    def shape(self, deepest: int) -> tuple[np.ndarray, np.ndarray]:
        """For depths ``1..deepest``: the chance that a draft asked to go that deep reaches it, and its expected
        nodes there — from the drafter's trees so far (a chain that always reaches, before any)."""
        asked = self._asked[1 : deepest + 1] + _PRIOR_SHAPE
        return ((self._deep[1 : deepest + 1] + _PRIOR_SHAPE) / asked,
                (self._nodes[1 : deepest + 1] + _PRIOR_SHAPE) / asked)

    def plan(self, budget: int) -> int:
        """The depth to draft to before drafting: the most expected tokens per millisecond, drafting included
        (0: plain decoding pays best)."""
        deepest = min(budget, MAX_DEPTH)
        if deepest <= 0 or not self.can_pay(deepest):
            return 0
        key = (deepest, self._cost_now, self._shared, self._counts_version)
        if self._last_plan is None or self._last_plan[0] != key:
            self._last_plan = (key, self._plan(deepest))
        return self._last_plan[1]

    def _plan(self, deepest: int) -> int:
        reach, width = self.shape(deepest)
        nodes = 1.0 + np.concatenate([[0.0], np.cumsum(width)])
        rows, tokens = self._shared
        # round() and np.rint both round halves to even
        verify_ms = self._row_ms.read(self._cost_now, rows + np.maximum(1, np.rint(nodes).astype(np.int64)))
        ms = self.draft_costs()[: deepest + 1] + verify_ms
        return _most_per_ms(reach * self.rates(deepest), ms, tokens)

    def draft_costs(self) -> np.ndarray:
        """``draft_cost(d)`` for ``d = 0..MAX_DEPTH`` (computed once: drafting costs do not change within a
        process)."""
        if self._draft_ms is None:
            self._draft_ms = np.array([self.draft_cost(d) for d in range(MAX_DEPTH + 1)], dtype=np.float64)
        return self._draft_ms

    def can_pay(self, deepest: int) -> bool:
        """Whether drafting could beat plain decoding by :data:`MIN_CEILING` if :data:`FLOOR_ACCEPTANCE` of a
        chain's draft tokens were accepted (computed once; drafting costs do not change within a process)."""
        if self._ceiling is None:
            plain, drafting = self.cost(1), self.draft_costs()
            self._ceiling = best_case_speedup(self.cost, lambda d: drafting[d], deepest, FLOOR_ACCEPTANCE)
            if self._ceiling < MIN_CEILING:
                log.warning("%s: drafting cannot pay on this machine (%.1f ms per drafted token against %.1f ms per "
                            "target step; at best %.2fx with %d %% of its tokens accepted): decoding without drafts",
                            self.inner.name, self.draft_cost(1), plain, self._ceiling, round(100 * FLOOR_ACCEPTANCE))
        return self._ceiling >= MIN_CEILING

    def best_depth(self, tree: DraftTree, free: bool = False) -> int:
        """The cut depth of a proposed tree with the most expected tokens per millisecond of verification, read with
        the planned drafts' acceptance (``free``: the free proposals')."""
        deepest = min(int(tree.depths.max()), MAX_DEPTH)
        nodes_up_to = np.cumsum(np.bincount(tree.depths, minlength=deepest + 1))[: deepest + 1]
        rows, tokens = self._shared
        rates = (depth_rates(self._free_accepted, self._free_reached, deepest) if free else self.rates(deepest))
        return _most_per_ms(rates, self._row_ms.read(self._cost_now, rows + nodes_up_to), tokens)

    def _cut(self, tree: DraftTree, depth: int, probe: bool = False) -> DraftTree:
        """``tree`` cut to ``depth`` (``probe``: with only the first of that depth's nodes that
        :meth:`_probe_width` allows, :func:`probe_level`), counted in :attr:`cut_steps` when that drops nodes; the
        step's depth kept."""
        cut = probe_level(tree, depth, self._probe_width(tree, depth)) if probe else tree
        if depth < int(cut.depths.max()):
            cut = cut_to_depth(cut, depth)
        if cut.size < tree.size:
            self.cut_steps += 1
        self._depth = int(cut.depths.max())
        return cut

    def _probe_width(self, tree: DraftTree, depth: int) -> int:
        """How many of the explored level's nodes an exploration verifies: its first choice, and more while the
        rows they add cost at most :data:`PROBE_SHARE` of a one-token step (all of them on a flat curve, one on a
        Zen 1's, where REST's level of ~3.7 nodes cost ~1.1 steps)."""
        above = int(np.searchsorted(tree.depths, depth - 1, side="right"))
        level = int(np.searchsorted(tree.depths, depth, side="right")) - above
        rows = self._shared[0] + above
        allowed = self.cost(rows) + PROBE_SHARE * self.cost(1)
        width = 1
        while width < level and self.cost(rows + width + 1) <= allowed:
            width += 1
        return width

    # ----------------------------------------------------------------- drafting
    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        self._steps += 1
        if self.search_gate is not None and not self.search_gate.due(self.inner.name):
            # a retrieval drafter's gated step neither searches nor prices anything
            self.gated_steps += 1
            self._proposed = False
            self._depth = 0
            return self._timed(root_only(int(context[-1])))
        self._cost_now = self._curve.at(context.shape[0])
        if self._retrieval:
            return self._timed(self._search_and_cut(context, budget))
        planned = self.plan(budget)
        self._exploring = self._steps >= self._next_explore and budget > 0 and self.can_pay(min(budget, MAX_DEPTH))
        if self._exploring:
            planned = min(planned + 1, budget)
            self._next_explore = self._steps + self._backoff.interval
        self._proposed = planned > 0
        self._planned = planned
        if not self._proposed:  # the step is not the plan's: its verdict teaches the plan nothing
            self.skipped_steps += 1
            self._depth = 0
            free = self.inner.free_proposal(context, budget)
            return root_only(int(context[-1])) if free is None else self._cut_free(free)
        if self.window is not None:  # the drafter stops token by token, by its tokens' confidence
            self.window.start(*self._shared)
            tree = self.inner.propose(context, budget)
            if self.inner.proposed_free:  # HSDDW's retrieval level alone, its middle model not started yet
                self._proposed = False
                self._depth = 0
                return self._cut_free(tree)
            self._proposed = tree.num_drafted > 0  # none: its draft model has not started on this generation
            if self._proposed:
                self._learn_shape(tree, budget)
            self._depth = int(tree.depths.max())
            return tree
        # a drafter that pays per drafted token (retrieval took _search_and_cut) drafts only what is planned
        tree = self.inner.propose(context, planned)
        self._learn_shape(tree, planned)
        if self._exploring:
            return self._cut(tree, planned, probe=True)
        return self._cut(tree, self.best_depth(tree))

    def _search_and_cut(self, context: np.ndarray, budget: int) -> DraftTree:
        """A retrieval drafter's step: search, then cut what was found to its best depth (one level deeper, probed,
        in an exploration step). No plan decides beforehand whether to search: a search costs next to nothing
        beside a forward (the search gate stops one that does not pay), while a plan is an expectation over the
        steps that find nothing too — on a Zen 1's steep curve (a second row +39 %) it priced out ~1,200 of ~6,300
        prompt-lookup steps on 65 dev questions, found trees the cut would have kept among them (searched every
        step, 7 % fewer forwards at the same search gate)."""
        self._proposed = budget > 0
        self._depth = 0
        if not self._proposed:
            return root_only(int(context[-1]))
        started = time.perf_counter()
        tree = self.inner.propose(context, budget)
        if self.search_gate is not None:
            self._search_ms = 1e3 * (time.perf_counter() - started)
        depth = self.best_depth(tree) if tree.num_drafted else 0
        self._exploring = depth < int(tree.depths.max()) and self._steps >= self._next_explore
        if self._exploring:
            depth += 1
            self._next_explore = self._steps + self._backoff.interval
        self._planned = depth
        return self._cut(tree, depth, probe=self._exploring)

    def _timed(self, tree: DraftTree) -> DraftTree:
        """``tree``, a retrieval step's proposal: its rows kept for the search gate's account and its verification
        timed by :attr:`_loop` where the gate needs it (one generation alone in its forwards: a batch's step times
        every generation's rows)."""
        self._search_rows = tree.size
        if self.search_gate is not None and self._shared[0] == 0:
            self._loop.proposed(tree.size)
        return tree

    def _rows_ms(self) -> float:
        """What verifying the step's found tree added against verifying its root alone: the drafted rows at what the
        decoding loop was seen to pay for one (:class:`LoopRowCost`), else on the cost curve beside the other
        generations' rows in a batch (0 for a tree that is its root alone)."""
        shared = self._shared[0]
        per_row = self._loop.per_row() if shared == 0 else None
        if per_row is not None:
            return per_row * (self._search_rows - 1)
        return max(0.0, self.cost(shared + self._search_rows) - self.cost(shared + 1))

    def _cut_free(self, tree: DraftTree) -> DraftTree:
        """A free proposal cut to the depth with the most expected tokens per millisecond of verification, read
        with the acceptance seen on free proposals (HSDDW's retrieval level sent alone: uncut, prompt lookup's up
        to 16-token trees cost SmolLM2's `hsddw` 1.150x `ar` against `pld`'s 1.264x on 26 dev questions)."""
        self._free = tree.num_drafted > 0
        return self._cut(tree, self.best_depth(tree, free=True)) if self._free else tree

    def _learn_shape(self, tree: DraftTree, asked: int) -> None:
        depth = min(int(tree.depths.max()), MAX_DEPTH)
        self._counts_version += 1
        for counts in (self._asked, self._deep, self._nodes):
            counts *= DECAY
        self._asked[1 : min(asked, MAX_DEPTH) + 1] += 1
        self._deep[1 : depth + 1] += 1
        self._nodes += np.bincount(np.minimum(tree.depths, MAX_DEPTH), minlength=MAX_DEPTH + 1)

    def observe(self, verdict: Verdict, context: np.ndarray) -> None:
        self._loop.verified()
        self.inner.observe(verdict, context)  # the context grew, and the target's verdict on the root is news too
        if self._free:
            self._free = False
            _count_verdict(self._free_reached, self._free_accepted, self._depth, len(verdict.path))
        if not self._proposed:
            return
        depth = min(self._depth, MAX_DEPTH)
        accepted = min(len(verdict.path), depth)
        if self._search_ms is not None:  # each accepted token saved about a one-token step; the tree's rows cost
            self.search_gate.searched(self.inner.name, self._search_ms, accepted, self.cost(1), self._rows_ms())
            self._search_ms = None
        _count_verdict(self._reached, self._accepted, depth, accepted)
        self._counts_version += 1
        if self.window is not None:
            self.window.learn(depth, accepted)
        if self._exploring:
            # found: the explored depth was reached and accepted (a window may have drafted past it)
            self._backoff.record(found=0 < min(depth, self._planned) <= accepted)

    def finish(self, context: np.ndarray) -> None:
        self.inner.finish(context)

    def learned(self) -> dict:
        """The decayed counts by depth, the exploration's back-off, the token window's rates and the wrapped
        drafter's own :meth:`learned`."""
        return {"depths": (self._reached, self._accepted, self._asked, self._deep, self._nodes),
                "free_depths": (self._free_reached, self._free_accepted),
                "backoff": self._backoff, "window": None if self.window is None else self.window.rates,
                "search_gate": self.search_gate, "inner": self.inner.learned()}

    def resume(self, learned: object) -> None:
        if not isinstance(learned, dict):
            return
        self._reached, self._accepted, self._asked, self._deep, self._nodes = learned["depths"]
        self._counts_version += 1
        if learned.get("free_depths") is not None:  # kept since the fifty-ninth session
            self._free_reached, self._free_accepted = learned["free_depths"]
        self._backoff = learned["backoff"]
        self._next_explore = self._steps + self._backoff.interval
        if self.window is not None and learned["window"] is not None:
            self.window.rates = learned["window"]
        if self.search_gate is not None and isinstance(learned.get("search_gate"), SourceGate):
            self.search_gate = learned["search_gate"]
        if learned["inner"] is not None:
            self.inner.resume(learned["inner"])

    def report(self) -> dict:
        window = {"window_stops": self.window.stops} if self.window is not None else {}
        gate = {} if self.search_gate is None else {"search_gate": self.search_gate.report()[self.inner.name],
                                                    "gated_steps": self.gated_steps}
        return {**self.inner.report(), "cost_cut_steps": self.cut_steps, "cost_skipped_steps": self.skipped_steps,
                **window, **gate}

    def problems(self) -> list[str]:
        return self.inner.problems()

    def describe(self) -> dict:
        return {**self.inner.describe(), "cost_aware": True, "draft_ms_per_token": round(self.draft_cost(1), 3)}


class LoopRowCost:
    """What a drafted row costs the decoding loop, as observed: the milliseconds from a proposal to its verdict (the
    verification forward and the loop's work on the tree) as decayed means over the steps that verify the root alone
    and, per row beyond the root, over the steps that verify more. The cost curve is timed on bare forwards at one
    moment and misprices a drafted row in the loop both ways (seventy-fourth session: SmolLM2 0.1-0.16 ms on its
    curve against ~0.7 in the loop, Qwen2.5-Coder-1.5B 3.3-4.3 against ~2.5)."""

    def __init__(self, decay: float = LOOP_DECAY, warmup: int = LOOP_WARMUP) -> None:
        self.decay, self.warmup = decay, warmup
        self._root_ms, self._roots = 0.0, 0  # decayed mean of a root-alone step, and how many were seen
        self._row_ms, self._rowed = 0.0, 0  # decayed mean of a drafted row's extra, and how many steps gave one
        self._since: float | None = None
        self._rows = 1

    def proposed(self, rows: int) -> None:
        """A tree of ``rows`` nodes (root included) goes to the target now."""
        self._since, self._rows = time.perf_counter(), rows

    def forget_pending(self) -> None:
        """Drop a proposal whose verdict will not come (its generation ended)."""
        self._since = None

    def verified(self) -> None:
        """Its verdict is back: account the step (nothing when no timed proposal is pending)."""
        if self._since is None:
            return
        ms = 1e3 * (time.perf_counter() - self._since)
        self._since = None
        if self._rows <= 1:
            self._root_ms = ms if self._roots == 0 else self._root_ms + self.decay * (ms - self._root_ms)
            self._roots += 1
        elif self._roots:
            extra = (ms - self._root_ms) / (self._rows - 1)
            self._row_ms = extra if self._rowed == 0 else self._row_ms + self.decay * (extra - self._row_ms)
            self._rowed += 1

    def per_row(self) -> float | None:
        """Milliseconds a drafted row adds to a step, once ``warmup`` steps of each kind were seen; ``None`` before."""
        if self._roots < self.warmup or self._rowed < self.warmup:
            return None
        return max(0.0, self._row_ms)


class _RowCosts:
    """A cost curve read at many row counts at once: each count's cost computed once per curve (the plan reads up
    to :data:`MAX_DEPTH` + 1 counts every step; one curve serves a whole context step)."""

    def __init__(self) -> None:
        self._curve: Callable[[int], float] | None = None
        self._ms = np.zeros(1)  # index = rows (0 never read)

    def read(self, curve: Callable[[int], float], rows: np.ndarray) -> np.ndarray:
        """``curve(r)`` for every ``r`` of ``rows`` (each >= 1)."""
        if curve is not self._curve:
            self._curve, self._ms = curve, np.zeros(1)
        known, most = self._ms.shape[0], int(rows.max())
        if most >= known:
            self._ms = np.concatenate([self._ms, [curve(r) for r in range(known, most + 1)]])
        return self._ms[rows]


def depth_rates(accepted: np.ndarray, reached: np.ndarray, deepest: int) -> np.ndarray:
    """Estimated chance of accepting at least ``d`` draft tokens given a draft that deep, ``d = 1..deepest``, from
    decayed counts by depth (``reached[d]``: verified trees at least ``d`` deep; ``accepted[d]``: of those, the ones
    that accepted at least ``d``); never higher at a depth than at the one above it.

    Depth 1 starts from one success in two trials; each deeper depth from the continuation its shallower rates show
    (``r(d-1)² / r(d-2)``, ``r(0) = 1``: the same chance of going one token further), so a drafter whose drafts pass
    95 % of the time plans deep at once instead of earning each depth at a prior of one half, and one that fails
    often plans shallow."""
    rates = []
    before, above = 1.0, 1.0  # r(d-2), r(d-1)
    # Python floats, not NumPy scalars: the same float64 arithmetic at a fraction of the cost (every step)
    for hits, trials in zip(accepted[1 : deepest + 1].tolist(), reached[1 : deepest + 1].tolist()):
        prior = _PRIOR_HITS / _PRIOR_TRIALS if not rates else above * above / before
        rate = min((hits + _PRIOR_TRIALS * prior) / (trials + _PRIOR_TRIALS), above)
        rates.append(rate)
        before, above = above, rate
    return np.asarray(rates, dtype=np.float64)


def _count_verdict(reached: np.ndarray, accepted: np.ndarray, depth: int, kept: int) -> None:
    """Decay the counts by depth, then count a verified tree ``depth`` deep of which ``kept`` tokens passed."""
    depth = min(depth, MAX_DEPTH)
    reached *= DECAY
    accepted *= DECAY
    reached[1 : depth + 1] += 1
    accepted[1 : min(kept, depth) + 1] += 1


def _most_per_ms(gains: np.ndarray, ms: np.ndarray, shared_tokens: float = 0.0) -> int:
    """The depth ``D`` (0..len(gains)) with the most expected tokens, ``shared_tokens + 1 + gains[:D].sum()`` (the
    other generations' in the same forward first), per ``ms[D]``."""
    expected = shared_tokens + 1.0 + np.concatenate([[0.0], np.cumsum(gains)])
    return int(np.argmax(expected / np.asarray(ms)))


def cut_to_depth(tree: DraftTree, depth: int) -> DraftTree:
    """The tree's nodes up to ``depth`` (a breadth-first prefix, so indices and parents stay valid)."""
    return cut_to_nodes(tree, int(np.searchsorted(tree.depths, depth, side="right")))


def probe_level(tree: DraftTree, depth: int, width: int = 1) -> DraftTree:
    """The tree's nodes above ``depth`` and only the first ``width`` of those at ``depth`` (its drafter's first
    choices there)."""
    above = int(np.searchsorted(tree.depths, depth - 1, side="right"))
    return cut_to_nodes(tree, min(above + width, int(np.searchsorted(tree.depths, depth, side="right"))))


def cut_to_nodes(tree: DraftTree, keep: int) -> DraftTree:
    """The tree's first ``keep`` nodes, root included (a breadth-first prefix: indices and parents stay valid)."""
    return DraftTree(
        tokens=tree.tokens[:keep], parents=tree.parents[:keep], depths=tree.depths[:keep],
        sources=tree.sources[:keep], probs=None if tree.probs is None else tree.probs[:keep],
        dists=None if tree.dists is None else tree.dists[:keep],
    )
