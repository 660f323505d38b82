"""Scored draft trees: every candidate node carries an estimated probability of acceptance, and the tree is the
best-first set of nodes whose expected accepted length per millisecond is highest.

A candidate is a draft sequence from one database with a confidence bin (the database's own evidence: rank, share
of counts, similarity). :class:`AcceptanceModel` learns, per (source, confidence bin, depth), the probability that a
node is accepted given that its parent was — from every verified tree, the rejected branches included; a depth
without evidence starts from the rate of the depth above it (a depth the tree never reached would otherwise keep a
pessimistic prior and never be tried: ``hd`` drafted one token per step through whole copied passages that
prompt lookup drafted five at a time). A node's
probability of lying on the accepted path is the product of those rates along its path, so for greedy decoding the
expected tokens of a step are ``1 + Σ p(node)`` over the tree's nodes (siblings exclude each other).
:func:`select_tree` takes nodes in decreasing ``p`` (a parent always before its children) and keeps the prefix
maximising ``(1 + Σ p) / cost(size)`` on the target's cost curve — which is flat within each of the runtime's bucket
sizes, so free rows get filled and an empty draft wins when nothing pays.

Example: candidates ``[5, 6]`` (rates 0.8, 0.7) and ``[7]`` (rate 0.3) give nodes ``5`` (p 0.8), ``5→6``
(0.56) and ``7`` (0.3); with a cost of 10 ms up to 4 tree rows and 20 ms beyond, all three are kept (expected 2.66
tokens for 10 ms).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hierspec.accept import Verdict
from hierspec.tree import ROOT_SOURCE, DraftTree, root_only

#: depth bins: depths 1, 2, 3, 4, 5-6, 7+ (a sequence's later tokens are accepted less often)
_DEPTH_BINS = (0, 0, 1, 2, 3, 4, 4, 5)  # indexed by depth (0 is the root)
#: confidence bins per source (0 = strongest evidence)
CONFIDENCE_BINS = 4
#: weight of a cell's prior, in trials: a (source, bin) pair's first depth starts from this many trials at
#: :attr:`AcceptanceModel.prior`, each deeper depth from as many trials at the rate of the depth above it
PRIOR_TRIALS = 4.0
#: who learns the verdict on a node several databases proposed (the node is scored at the best of their estimates):
#: ``best`` — the database whose estimate that was; ``shared`` — each of them, for an equal share of a trial
#: (:class:`~hierspec.drafters.hierarchy.HierarchyConfig`'s ``credit`` says what each measured)
CREDITS = ("best", "shared")
DEFAULT_CREDIT = "shared"
#: the default first-depth prior (why 1 in 2: :class:`~hierspec.drafters.hierarchy.HierarchyConfig`'s ``prior``)
DEFAULT_PRIOR = 0.5


class ContextCost:
    """A verification cost curve that grows with the context under the tree: ``cost(rows)`` at the context the
    curve was measured at, ``cost.at(context)(rows)`` at another, interpolated linearly in the context between the
    two measured contexts and extended beyond them (attention's work grows with rows x context: SmolLM2's int4 path
    on a Zen 4, a 2-token tree over 64 / 1,024 cached tokens costs 12.9 / 19.7 ms).

    Args:
        rows_cost: the cost of ``rows`` at ``context`` (already read at the runtime's bucket sizes).
        long_cost: the same at ``long_context``, or ``None`` when only one context was measured (the cost then
            does not depend on it).
        milliseconds: whether the costs are measured milliseconds (a calibrated curve), which other times (a
            search's, a draft model's) may be added to; else only relative (:func:`linear_cost`).
    """

    def __init__(self, rows_cost: Callable[[int], float], context: int = 0,
                 long_cost: Callable[[int], float] | None = None, long_context: int = 0,
                 milliseconds: bool = False) -> None:
        self.milliseconds = milliseconds
        self._base = functools.lru_cache(maxsize=None)(rows_cost)
        self._long = long_cost if long_context > context else None
        self.context, self.long_context = context, long_context
        self._by_step: dict[int, Callable[[int], float]] = {}

    @staticmethod
    def of(cost: Callable[[int], float]) -> ContextCost:
        """``cost`` itself when it is a :class:`ContextCost`, else one that does not grow with the context."""
        return cost if isinstance(cost, ContextCost) else ContextCost(cost)

    def __call__(self, rows: int) -> float:
        return self._base(rows)

    def at(self, context: int) -> Callable[[int], float]:
        """The cost curve over ``context`` cached tokens, read at the measured context plus a whole number of
        :data:`CONTEXT_STEP` tokens at or above ``context`` (each such curve computed once)."""
        if self._long is None:
            return self._base
        steps = max(0, -(-(int(context) - self.context) // CONTEXT_STEP))
        if steps not in self._by_step:
            self._by_step[steps] = self._curve_at(steps * CONTEXT_STEP / (self.long_context - self.context))
        return self._by_step[steps]

    def _curve_at(self, share: float) -> Callable[[int], float]:
        """The short curve plus ``share`` of the long curve's excess over it, per row count."""
        long = self._long

        @functools.lru_cache(maxsize=None)
        def cost(rows: int) -> float:
            base = self._base(rows)
            return base + share * max(0.0, long(rows) - base)

        return cost


#: contexts are read in steps of this many tokens (each step's curve is computed once)
CONTEXT_STEP = 128


def linear_cost(rows: int) -> float:
    """A verification cost when none is measured: one step plus 2 % per extra tree row (the runtime's goal: a
    16-row tree at most 1.3x a one-row step)."""
    return 1.0 + 0.02 * (rows - 1)


def depth_bin(depth: int) -> int:
    """The depth bin of a node ``depth`` tokens below the root (1-based)."""
    return _DEPTH_BINS[min(depth, len(_DEPTH_BINS) - 1)]


@dataclass(frozen=True)
class Candidate:
    """One draft sequence with its source and the source's confidence bin (``0`` = most confident)."""

    tokens: tuple[int, ...]
    source: str
    confidence: int = 0


@dataclass
class AcceptanceModel:
    """Running conditional acceptance rates per (source, confidence bin, depth bin), with a weak prior.

    ``decay`` < 1 weighs recent steps more (the rates follow the text being generated); ``prior`` is the rate a
    (source, bin) pair's first depth starts from, worth :data:`PRIOR_TRIALS` trials; ``credit`` (:data:`CREDITS`)
    says which cells learn a node several databases proposed.
    """

    sources: Sequence[str]
    decay: float = 0.999
    prior: float = DEFAULT_PRIOR
    credit: str = DEFAULT_CREDIT
    trials: np.ndarray = field(init=False)
    hits: np.ndarray = field(init=False)
    predicted: np.ndarray = field(init=False)
    observed: np.ndarray = field(init=False)
    counted: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.prior < 1.0:
            raise ValueError(f"an acceptance prior must lie strictly between 0 and 1, not {self.prior}")
        if self.credit not in CREDITS:
            raise ValueError(f"credit {self.credit!r}: use one of {', '.join(CREDITS)}")
        self._index = {name: i for i, name in enumerate(self.sources)}
        shape = (len(self.sources), CONFIDENCE_BINS, max(_DEPTH_BINS) + 1)
        self.trials = np.zeros(shape)
        self.hits = np.zeros(shape)
        self.predicted = np.zeros(10)  # calibration: summed predicted p per decile of p
        self.observed = np.zeros(10)  # ... and nodes that did land on the accepted path
        self.counted = np.zeros(10)

    def reset_calibration(self) -> None:
        """Zero the calibration counts (a new generation); the rates themselves are kept."""
        for counts in (self.predicted, self.observed, self.counted):
            counts[:] = 0

    def cell(self, source: str, confidence: int, depth: int) -> tuple[int, int, int]:
        """The (source, confidence bin, depth bin) cell counting nodes like this one."""
        return self._index[source], min(confidence, CONFIDENCE_BINS - 1), depth_bin(depth)

    def rate(self, source: str, confidence: int, depth: int) -> float:
        """Probability that a node is accepted given that its parent was."""
        return float(self.rates()[self.cell(source, confidence, depth)])

    def rates(self) -> np.ndarray:
        """Every cell's rate, ``[sources, confidence bins, depth bins]``: the first depth bin's counts over
        :data:`PRIOR_TRIALS` trials at :attr:`prior`, each deeper bin's over as many trials at the rate of the bin
        above it."""
        rates = np.empty_like(self.trials)
        prior = np.full(self.trials.shape[:2], self.prior)
        for level in range(self.trials.shape[2]):
            prior = (self.hits[..., level] + PRIOR_TRIALS * prior) / (self.trials[..., level] + PRIOR_TRIALS)
            rates[..., level] = prior
        return rates

    def rates_of(self, source: int, confidence: int) -> list[float]:
        """One (source, confidence bin) row of :meth:`rates`, computed alone (the same float operations in the same
        order, so the same values): a step reads only the few rows its candidates fall in."""
        hits, trials = self.hits[source, confidence].tolist(), self.trials[source, confidence].tolist()
        prior, row = self.prior, []
        for level_hits, level_trials in zip(hits, trials):
            prior = (level_hits + PRIOR_TRIALS * prior) / (level_trials + PRIOR_TRIALS)
            row.append(prior)
        return row

    def learn(self, tree: "ScoredTree", verdict: Verdict) -> None:
        """Count, for every node whose parent was accepted, whether the node was accepted too."""
        self.trials *= self.decay
        self.hits *= self.decay
        accepted = np.zeros(tree.tree.size, dtype=bool)
        accepted[0] = True
        accepted[list(verdict.path)] = True
        for node in range(1, tree.tree.size):
            probability = tree.path_probability[node]
            decile = min(int(probability * 10), 9)
            self.predicted[decile] += probability
            self.observed[decile] += accepted[node]
            self.counted[decile] += 1
            if accepted[int(tree.tree.parents[node])]:
                credited = tree.proposers[node]
                if self.credit == "shared" and len(credited) > 1:
                    share = 1.0 / len(credited)
                    for cell in credited:
                        self.trials[cell] += share
                        self.hits[cell] += share * accepted[node]
                else:
                    cell = tree.cells[node]
                    self.trials[cell] += 1
                    self.hits[cell] += accepted[node]

    def calibration_counts(self) -> dict:
        """Per decile of predicted probability (of landing on the accepted path): nodes, their summed prediction
        and how many did land there — summable over generations."""
        return {"nodes": self.counted.tolist(), "predicted": self.predicted.tolist(),
                "accepted": self.observed.tolist()}


@dataclass(frozen=True)
class ScoredTree:
    """A selected tree with, per node, its estimated probability of lying on the accepted path, its model cell (its
    best estimate's) and the cells of every database that proposed it (one each, the first it was proposed in)."""

    tree: DraftTree
    path_probability: np.ndarray
    cells: tuple[tuple[int, int, int], ...]
    proposers: tuple[tuple[tuple[int, int, int], ...], ...]

    @property
    def expected_tokens(self) -> float:
        """Expected tokens of the step: the bonus token plus the expected accepted drafts."""
        return 1.0 + float(self.path_probability[1:].sum())


def select_tree(root: int, candidates: Sequence[Candidate], model: AcceptanceModel, cost: Callable[[int], float],
                budget: int, shared: tuple[int, float] = (0, 0.0)) -> ScoredTree:
    """The best-first subtree of the candidates' trie with the most expected tokens per unit of ``cost``.

    ``cost(rows)`` is the verification cost of a tree of ``rows`` nodes (root included); at most ``budget`` draft
    nodes are kept. A node reached by several candidates keeps its best estimate (and every proposer's cell, for
    :meth:`AcceptanceModel.learn`). ``shared``: other generations'
    rows and expected tokens in the same (batched) forward, so that the tree maximises the whole forward's tokens
    per unit of cost.
    """
    trie = _Trie()
    rows_read: dict[tuple[int, int], list[float]] = {}  # Python floats: a NumPy element read costs ~10x more
    for candidate in candidates:
        source, confidence, _ = model.cell(candidate.source, candidate.confidence, 1)
        by_level = rows_read.get((source, confidence))
        if by_level is None:
            by_level = rows_read[source, confidence] = model.rates_of(source, confidence)
        trie.extend(candidate.tokens, by_level, candidate.source, source, confidence)
    if trie.size == 1 or budget <= 0:
        return _empty(root)
    p = np.asarray(trie.probability)
    depth = np.asarray(trie.depth)
    order = np.lexsort((depth[1:], -p[1:]))[:budget] + 1  # p descending, shallower first: parents come first
    rows, tokens = shared
    gains = tokens + 1.0 + np.concatenate([[0.0], np.cumsum(p[order])])
    costs = np.fromiter(map(cost, range(rows + 1, rows + 1 + gains.shape[0])), dtype=np.float64,
                        count=gains.shape[0])
    keep = int(np.argmax(gains / costs))
    if keep == 0:
        return _empty(root)
    nodes = trie.breadth_first(sorted(order[:keep].tolist()))
    tree = DraftTree(tokens=np.array([root] + [trie.token[n] for n in nodes[1:]], dtype=np.int64),
                     parents=np.array(trie.parents_in(nodes), dtype=np.int64),
                     depths=depth[nodes].astype(np.int64),
                     sources=(ROOT_SOURCE,) + tuple(trie.source[n] for n in nodes[1:]))
    return ScoredTree(tree, p[nodes], tuple(trie.cell[n] for n in nodes), tuple(trie.proposers[n] for n in nodes))


def _empty(root: int) -> ScoredTree:
    return ScoredTree(root_only(root), np.ones(1), ((0, 0, 0),), (((0, 0, 0),),))


class _Trie:
    """Candidate nodes: token, parent, depth, best path probability, source and model cell of each (node ids grow
    with insertion, so a parent's id is below its children's)."""

    def __init__(self) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.token, self.parent, self.depth = [-1], [-1], [0]
        self.probability = [1.0]
        self.source = [ROOT_SOURCE]
        self.cell: list[tuple[int, int, int]] = [(0, 0, 0)]
        self.proposers: list[tuple[tuple[int, int, int], ...]] = [((0, 0, 0),)]

    @property
    def size(self) -> int:
        return len(self.token)

    def extend(self, tokens: Sequence[int], by_level: Sequence[float], source: str, source_index: int,
               confidence: int) -> None:
        """Add a candidate's path from the root: each node created, or improved to a better probability (the
        product of ``by_level``'s rates along the path, read at each depth's bin)."""
        children, probability = self.children, self.probability
        node = 0
        for depth, token in enumerate(tokens, start=1):
            level = depth_bin(depth)
            estimate = probability[node] * by_level[level]
            cell = (source_index, confidence, level)
            child = children[node].get(token)
            if child is None:
                child = len(self.token)
                children[node][token] = child
                children.append({})
                self.token.append(int(token))
                self.parent.append(node)
                self.depth.append(depth)
                probability.append(estimate)
                self.source.append(source)
                self.cell.append(cell)
                self.proposers.append((cell,))
            else:
                if all(known[0] != source_index for known in self.proposers[child]):
                    self.proposers[child] += (cell,)
                if estimate > probability[child]:
                    probability[child], self.source[child], self.cell[child] = estimate, source, cell
            node = child

    def breadth_first(self, chosen: Sequence[int]) -> list[int]:
        """The root and ``chosen`` (ascending ids, closed under parents) breadth-first, siblings in id order: the
        order :func:`~hierspec.tree.build_tree` gives their paths taken in that order."""
        below: dict[int, list[int]] = {}
        for node in chosen:
            below.setdefault(self.parent[node], []).append(node)
        order = [0]
        for node in order:  # grows while it is read
            order.extend(below.get(node, ()))
        return order

    def parents_in(self, order: Sequence[int]) -> list[int]:
        """Each node's parent as a position in ``order`` (-1 for the root)."""
        position = {node: index for index, node in enumerate(order)}
        return [-1] + [position[self.parent[node]] for node in order[1:]]
