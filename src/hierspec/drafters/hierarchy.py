"""Hierarchy Drafting (Cho et al., 2025): three draft databases read in order of temporal locality.

* ``c`` — context-dependent (:class:`~hierspec.drafters.context_db.ContextDB`): n-grams of this generation's prompt,
  committed tokens and the target's predictions at every verified tree node (tokens it computed anyway).
* ``m`` — model-dependent (:class:`~hierspec.datastore.ngram.NgramTable`): the most frequent n-grams of the
  target's own past generations.
* ``s`` — statistics-dependent (:class:`~hierspec.datastore.suffix.SuffixStore`): continuations of the context's
  longest suffix found in a large corpus.
* ``d`` — optional fourth source, dense retrieval (:class:`~hierspec.drafters.dense.DenseRetriever`, DReSD): next
  tokens of the nearest neighbours of the target's hidden state. Not in the default order; add it, e.g.
  ``order=cdms``.
* ``t`` — the successor table (:class:`~hierspec.datastore.successors.SuccessorTable`, Token Recycling's idea): the
  target's top-k after every token, recycled from every verification forward and kept across generations.
* ``a`` and ``o`` — longest suffix matches (:mod:`hierspec.drafters.suffix_sources`): ``a`` in this generation's
  own prompt and tokens (a suffix automaton; first in the default order ``acmst``), ``o`` in the earlier outputs of
  this process (not in the default order); ranked by match length.
* ``h`` — a trained draft head (:mod:`hierspec.drafters.head_source`): the target's likely tokens after the root,
  guessed from its hidden state at the last accepted node (read when a ``head`` store is found; in the default
  order).

Each step reads the databases in ``order``. With ``tree=scored`` (the default) every database offers up to
``candidates`` sequences, each node is scored with its estimated probability of acceptance, and the tree is the
best-first set of nodes that maximises expected tokens per millisecond on the target's cost curve
(:mod:`hierspec.drafters.scored`). With ``tree=fixed`` the databases are read until ``n`` sequences are collected
and merged as they are (the paper's access, with the ``lead`` rule). Each node is tagged with its database.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hierspec.accept import Verdict
from hierspec.datastore.draft_head import HeadStore
from hierspec.datastore.learning import LearningStore
from hierspec.datastore.ngram import NgramTable
from hierspec.datastore.recent_outputs import RecentOutputs
from hierspec.datastore.successors import SuccessorTable
from hierspec.datastore.suffix import SuffixStore
from hierspec.drafters.base import Drafter
from hierspec.drafters.context_db import ContextDB
from hierspec.drafters.dense import DenseConfig, DenseRetriever
from hierspec.drafters.exploration import ExplorationBackOff
from hierspec.drafters.head_source import HeadDatabase
from hierspec.drafters.hsddw import pre_verified
from hierspec.drafters.registry import register
from hierspec.drafters.retrieval_gate import RetrievalGate
from hierspec.drafters.scored import (CREDITS, DEFAULT_CREDIT, DEFAULT_PRIOR, AcceptanceModel, Candidate,
                                      ContextCost, ScoredTree, linear_cost, select_tree)
from hierspec.drafters.source_gate import SourceGate
from hierspec.drafters.suffix_sources import AutomatonDatabase, OutputsDatabase
from hierspec.errors import InputError
from hierspec.tree import DraftTree, build_tree, is_prefix, root_only

log = logging.getLogger(__name__)

SOURCE_NAMES = {"c": "context", "m": "model", "s": "statistics", "d": "dense", "t": "successors", "a": "automaton",
                "o": "outputs", "h": "head"}


@dataclass(frozen=True)
class HierarchyConfig:
    """Hierarchy Drafting settings (defaults chosen on the dev questions, see BENCHMARKS.md).

    Attributes:
        l: key length of the context database (the model store's key length is fixed when it is built).
        m: tokens per draft sequence (value length).
        n: draft sequences per step (``N``), also the context database's values per key.
        order: databases to read, in order: letters ``c`` (context), ``m`` (model), ``s`` (statistics), ``d``
            (dense retrieval, needs a dense store), ``t`` (successor table), ``a`` (longest match in the context's
            suffix automaton), ``o`` (longest match in this process's earlier outputs), ``h`` (a draft head's
            guesses, needs a head store).
        top_k: most frequent grams of the model store used (the table holds at most what it was built with).
        recycle_topk: target predictions recycled per verified node: 1 = top-1, k > 1 adds the next k - 1 as
            one-token values.
        min_count: model-store grams seen in fewer generations than this are not drafted.
        m_min_share: a model-store value must hold at least this share of its key's count.
        s_n_min: shortest context suffix looked up in the statistics store.
        s_min_share: a statistics-store continuation must start at least this share of the retrieved ones.
        s_k: occurrences read from the statistics store per lookup.
        d_k: neighbours retrieved from the dense store per lookup.
        d_min_score: dense neighbours less similar than this (cosine) are not drafted.
        lead: (``tree=fixed``) databases whose drafts may make up a step's tree on their own; the others only add
            sequences to a step that a leading database already drafts for. ``"cms"`` is the paper's access; the
            default ``"ac"`` lets either context source lead (``a`` comes first in the default order).
        tree: ``"scored"`` — every node scored, the tree sized by the cost curve — or ``"fixed"`` — ``n``
            sequences of ``m`` tokens in access order, with ``lead``.
        candidates: (``tree=scored``) sequences read from each database per step.
        t_k: successors kept per token in the successor table (the verifier's top-k, computed every step when
            ``t`` is in ``order``).
        t_width: successor chains read per step (one from each of the root's best successors).
        learn: the model store keeps learning: every finished generation adds its n-grams and the successor table
            is persisted with it (:class:`~hierspec.datastore.learning.LearningStore`; created at the default
            location when no model store is given).
        flush_every: generations between two writes of a learning store.
        explore_every: (``tree=scored``) after this many steps in a row whose tree came out empty although the
            databases offered candidates, draft the best single node anyway, so that acceptance rates that fell
            below what pays can recover; the interval doubles (up to 128) while explorations are rejected and
            returns to this value when one is accepted. 0 turns exploring off.
        prior: (``tree=scored``) the acceptance rate a database's confidence bin starts from before the tree has
            tried it, worth four trials (1 in 2; 1 in 4 until the sixty-fifth session, when on a Zen 1's steep cost
            curve a node at 1 in 4 never paid and untried bins waited for an exploration: SmolLM2, 65 dev questions
            in one run, ``hd`` 1.069x ``ar`` (MAT 1.55) against 1.032x (MAT 1.30); no gain at 512 tokens or on
            Qwen2.5-Coder-1.5B).
        credit: (``tree=scored``) who learns the verdict on a node several databases proposed: ``shared`` — each
            of them, for an equal share of a trial (the default since the sixty-sixth session), or ``best`` — only
            the one whose estimate it was drafted at. With ``best`` the rates are bistable: the higher-rated
            database takes every shared node, the others learn only from the nodes where they disagree and can fall
            below what pays, and which one wins depends on the first steps (SmolLM2 on a Zen 1, runs of the same
            code on the same questions: 1.055-1.093x ``ar`` at 128 tokens, 1.064-1.270x at 512). ``shared`` repeats
            itself (two instances in one run within 0.2 %); against ``best`` it lost ~2 % on one set of 65 dev
            questions at 128 tokens (1.046-1.063x against 1.055-1.093x), gained ~2 % on another (1.043x against
            1.022-1.025x), lost ~1 % on a third (1.056x against 1.055-1.071x), gained ~1 % on 13 questions at 256
            tokens (1.112x against 1.097-1.106x) and ~4 % at 512 (1.251-1.260x against 1.204-1.270x), and lost ~2 %
            on Qwen2.5-Coder-1.5B without its stores (1.086x against 1.104-1.108x, 8 HumanEval problems): a
            database's lone nodes take the rate its shared ones earn, and on a Zen 1, where a row costs 0.4 of a
            step, some of them do not pay (BENCHMARKS.md, "Sixty-sixth session").
        a_len: (``tree=scored``) tokens per draft sequence of the longest-match sources ``a`` and ``o`` (``m`` is
            the others', and theirs too in a fixed tree):
            their continuations are accepted deep where the text repeats itself, and the scored tree keeps a deep
            node only where its learned rate pays (12 against 6, one run each, interleaved: SmolLM2 on 65 dev
            questions MAT 3.13 → 3.54 at 512 tokens; at 128 2.19 → 2.27, 1.270x → 1.305x ``ar``, within the
            spread of repeated runs;
            Qwen2.5-Coder-1.5B with its 0.5B draft on 12 HumanEval problems MAT 4.77 → 5.24, 1.806x → 1.851x;
            BENCHMARKS.md, "Fiftieth session").
        a_min_match: shortest context match the ``a`` source drafts from.
        o_min_match: shortest match in earlier outputs the ``o`` source drafts from.
        o_max_tokens: tokens of earlier outputs kept for ``o`` (the oldest are dropped; shared by the process).
        match_depth: ``a`` and ``o`` draft at most this many tokens per matched token (SuffixDecoding's cap);
            0 = up to ``a_len``.
        h_width: the draft head's guesses drafted per step (each continued by the successor table).
        h_gate: (``tree=scored``) after a step whose tree took none of the head's guesses, the head is not asked for
            one step, and for twice as many after each further such step, up to this many (back to every step when
            a guess is taken): at 8 concurrent requests trees are mostly empty and a guess per request and step cost
            7 % of the throughput. 1 asks the head at every step.
        search_gate: (``tree=scored``, on a measured cost curve) in a batch, search the databases only in steps
            where that pays, counting the search's own milliseconds and the other requests' rows, tokens and
            drafting time (:class:`~hierspec.drafters.retrieval_gate.RetrievalGate`): a step that does not verifies
            the root alone. A full batch, where the forward is shared and every request's search is not, then
            decodes as fast as ``ar`` does (26 dev requests at 8: 0.98x ``ar``, 0.92x without); alone ``hd``
            always searches (skipping there lost more accepted drafts than it saved).
        source_gate: (``tree=scored``, on a measured cost curve) search each database only while the time its
            accepted tokens save (a target step each) exceeds its search time, else every few steps, backing off up
            to 32 (:class:`~hierspec.drafters.source_gate.SourceGate`): on SmolLM2 with cheap forwards the ShareGPT
            statistics store and the draft head cost more than they saved (BENCHMARKS.md, "Forty-fourth session").
        draft: a draft model as one more source: ``auto`` (the default since the forty-third session) the
            command line's ``--draft-model`` when one is given, else none; ``off`` none; ``on`` the command line's
            ``--draft-model`` (an error without one); anything else names the model (``self:K``, an id, a directory
            or a ``.gguf``). The model then pre-verifies the databases' tree and continues it while it is
            confident, HSDDW's middle level (:func:`~hierspec.drafters.hsddw.pre_verified`): the databases' tokens
            it accepts cost one draft forward for all of them, and where they stop it drafts on by itself; the
            block it leaves is sized by the cost curves, and a step they price out sends the databases' tree alone.
            Qwen2.5-Coder-1.5B with the 0.5B (BENCHMARKS.md, forty-second and forty-third sessions): 2.46x ``ar``
            against 1.85x on 40 HumanEval problems, 1.69x against 1.69x on 26 dev questions (summarization 1.67x
            against 1.73x, every other task within 1 % or ahead).
        defer: (with ``draft``) the draft model starts on a long prompt only once the steps without it would pay
            for reading it (:mod:`hierspec.drafters.deferred_start`); until then the databases draft alone.
            ``False``: it starts at once.
    """

    l: int = 2  # noqa: E741 — the paper's name
    m: int = 6
    n: int = 2
    order: str = "acmsth"
    top_k: int = 100_000
    recycle_topk: int = 1
    min_count: int = 2
    m_min_share: float = 0.2
    s_n_min: int = 3
    s_min_share: float = 0.2
    s_k: int = 500
    d_k: int = 32
    d_min_score: float = 0.75
    lead: str = "ac"
    tree: str = "scored"
    candidates: int = 6
    t_k: int = 4
    t_width: int = 3
    learn: bool = False
    flush_every: int = 8
    explore_every: int = 8
    prior: float = DEFAULT_PRIOR
    credit: str = DEFAULT_CREDIT
    a_len: int = 12
    a_min_match: int = 1
    o_min_match: int = 2
    o_max_tokens: int = 100_000
    match_depth: float = 0.0
    h_width: int = 3
    h_gate: int = 8
    search_gate: bool = True
    source_gate: bool = True
    draft: str = "auto"
    defer: bool = True

    def __post_init__(self) -> None:
        if not self.draft:
            raise InputError("hd draft: use off, on (--draft-model) or a draft model (self:K, an id, a directory or "
                             "a .gguf)")
        if self.tree not in {"scored", "fixed"}:
            raise InputError(f"hd tree {self.tree!r}: use scored or fixed")
        if self.explore_every < 0:
            raise InputError("hd needs explore_every >= 0 (0: never explore)")
        if self.credit not in CREDITS:
            raise InputError(f"hd credit {self.credit!r}: use {' or '.join(CREDITS)}")
        if not 0.0 < self.prior < 1.0:
            raise InputError(f"hd prior {self.prior}: use a rate strictly between 0 and 1")
        if min(self.a_min_match, self.o_min_match) < 1 or self.o_max_tokens < 2 or self.match_depth < 0:
            raise InputError("hd needs a_min_match, o_min_match >= 1, o_max_tokens >= 2 and match_depth >= 0")
        if min(self.candidates, self.t_k, self.t_width, self.flush_every, self.h_width, self.h_gate) < 1:
            raise InputError("hd needs candidates, t_k, t_width, flush_every, h_width and h_gate >= 1")
        if min(self.l, self.m, self.a_len, self.n, self.top_k, self.recycle_topk, self.min_count, self.s_n_min,
               self.s_k) < 1:
            raise InputError("hd needs l, m, a_len, n, top_k, recycle_topk, min_count, s_n_min and s_k >= 1")
        if not self.order or set(self.order) - set(SOURCE_NAMES) or len(set(self.order)) != len(self.order):
            raise InputError(f"hd order {self.order!r}: use each of the letters {', '.join(SOURCE_NAMES)} at most "
                             "once, e.g. 'acmsth'")
        if not self.lead or set(self.lead) - set(SOURCE_NAMES):
            raise InputError(f"hd lead {self.lead!r}: use letters among {', '.join(SOURCE_NAMES)}")
        if not (0.0 <= self.s_min_share <= 1.0 and 0.0 <= self.m_min_share <= 1.0):
            raise InputError("hd needs 0 <= s_min_share <= 1 and 0 <= m_min_share <= 1")


def frequent_rows(rows: np.ndarray, limit: int, min_count: int) -> list[np.ndarray]:
    """The ``limit`` most frequent distinct rows (``-1`` padding trimmed) seen at least ``min_count`` times.

    Ties keep lexicographic order. Example: rows ``[[1, 2], [3, -1], [1, 2]]`` → ``[[1, 2], [3]]``.
    """
    return [row for row, _ in frequent_rows_with_shares(rows, limit, min_count)]


def frequent_rows_with_shares(rows: np.ndarray, limit: int, min_count: int) -> list[tuple[np.ndarray, float]]:
    """:func:`frequent_rows` with each row's share of all ``rows``."""
    if rows.shape[0] == 0 or limit <= 0:
        return []
    # a few dozen short rows a step: counted as tuples (np.unique over rows costs ~4x more), which sort as the rows do
    counts = Counter(map(tuple, rows.tolist()))
    out = []
    for row, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if count < min_count or len(out) == limit:
            break
        kept = next((i for i, token in enumerate(row) if token < 0), len(row))  # -1 pads a cut continuation
        if kept:
            out.append((np.array(row[:kept], dtype=rows.dtype), count / rows.shape[0]))
    return out


def share_bin(share: float) -> int:
    """Confidence bin of a continuation holding ``share`` of its key's evidence: >= 1/2, 1/4, 1/10, less."""
    return 0 if share >= 0.5 else 1 if share >= 0.25 else 2 if share >= 0.1 else 3


class DraftDatabase(Protocol):
    """What hierarchical access needs from a database: draft sequences for the current context."""

    def retrieve(self, context: np.ndarray, limit: int) -> Sequence[Sequence[int]]:
        """Up to ``limit`` draft sequences continuing ``context``, best first."""


@dataclass(frozen=True)
class ModelDatabase:
    """``D_m``: an n-gram table of the model's own generations, read by its key (the context's last tokens)."""

    table: NgramTable
    min_count: int = 1
    min_share: float = 0.0

    @property
    def directory(self):
        return self.table.directory

    def retrieve(self, context: np.ndarray, limit: int) -> list[np.ndarray]:
        return self.table.lookup(context, limit, self.min_count, self.min_share)

    def retrieve_scored(self, context: np.ndarray, limit: int) -> list[tuple[np.ndarray, int]]:
        """Sequences with confidence bins from their share of the key's count."""
        return [(v, share_bin(share)) for v, share in self.table.lookup_shares(context, limit, self.min_count,
                                                                              self.min_share)]


@dataclass(frozen=True)
class StatisticsDatabase:
    """``D_s``: the most frequent continuations of the context's longest suffix in a suffix-array corpus store."""

    store: SuffixStore
    value_len: int
    n_min: int = 3
    n_max: int = 16
    k: int = 500
    min_share: float = 0.0

    @property
    def directory(self):
        return self.store.directory

    def retrieve(self, context: np.ndarray, limit: int) -> list[np.ndarray]:
        return [row for row, _ in self.retrieve_scored(context, limit)]

    def retrieve_scored(self, context: np.ndarray, limit: int) -> list[tuple[np.ndarray, int]]:
        """Sequences with confidence bins from their share of the retrieved continuations (one bin lower when the
        matched suffix is short)."""
        match = self.store.longest_match(context, max(self.n_max, self.n_min), self.n_min)
        if match is None:
            return []
        rows = self.store.continuations(match, self.k, self.value_len)
        short = 1 if match.length < 4 else 0
        return [(row, min(3, share_bin(share) + short))
                for row, share in frequent_rows_with_shares(rows, limit, max(1, int(np.ceil(self.min_share * rows.shape[0]))))]


@dataclass(frozen=True)
class LearningDatabase:
    """``D_m`` read from a learning store: the store's current table, which each flush replaces."""

    store: LearningStore
    base: ModelDatabase | None = None

    @property
    def directory(self):
        return self.store.directory

    def retrieve_scored(self, context: np.ndarray, limit: int) -> list[tuple[np.ndarray, int]]:
        min_count, min_share = (self.base.min_count, self.base.min_share) if self.base is not None else (1, 0.0)
        return ModelDatabase(self.store.table, min_count, min_share).retrieve_scored(context, limit)

    def retrieve(self, context: np.ndarray, limit: int) -> list[np.ndarray]:
        return [seq for seq, _ in self.retrieve_scored(context, limit)]


@dataclass(frozen=True)
class SuccessorDatabase:
    """``t``: chains of first successors from the root's best successors, ranked."""

    table: SuccessorTable
    depth: int
    width: int = 3

    def retrieve_scored(self, context: np.ndarray, limit: int) -> list[tuple[list[int], int]]:
        return self.table.chains(int(context[-1]), self.depth, min(self.width, limit))

    def retrieve(self, context: np.ndarray, limit: int) -> list[list[int]]:
        return [chain for chain, _ in self.retrieve_scored(context, limit)]


class HierarchyDrafter(Drafter):
    """Drafts from the context, model and statistics databases, read in order until ``n`` sequences are found.

    ``model``, ``statistics`` and ``dense`` are optional: a letter of ``config.order`` whose database is missing is
    skipped, so HD works with the context database alone.
    """

    name = "hd"

    def __init__(self, config: HierarchyConfig | None = None, model: DraftDatabase | None = None,
                 statistics: DraftDatabase | None = None, dense: DenseRetriever | None = None,
                 cost: Callable[[int], float] | None = None, successors: SuccessorTable | None = None,
                 learning: LearningStore | None = None, outputs: RecentOutputs | None = None,
                 head: HeadStore | None = None, embeddings: torch.Tensor | None = None) -> None:
        self.config = config or HierarchyConfig()
        scored = self.config.tree == "scored"
        self.context_db = ContextDB(self.config.l, self.config.m,
                                    max(self.config.n, self.config.candidates) if scored else self.config.n)
        self.learning = learning
        if learning is not None:
            model, successors = LearningDatabase(learning, model), learning.successors
        self.successors = successors if "t" in self.config.order else None
        self.verifier_topk = max(self.config.recycle_topk, self.config.t_k if self.successors is not None else 1)
        successor_db = (SuccessorDatabase(self.successors, self.config.m, self.config.t_width)
                         if self.successors is not None else None)
        config = self.config
        self.automaton = (AutomatonDatabase(config.a_len, config.a_min_match, config.match_depth)
                          if "a" in config.order else None)
        self.outputs = (OutputsDatabase(outputs, config.a_len, config.o_min_match, config.match_depth)
                        if outputs is not None and "o" in config.order else None)
        self.head = (HeadDatabase(head, embeddings, config.m, config.h_width, self.successors)
                     if head is not None and embeddings is not None and "h" in config.order else None)
        available = {"c": self.context_db, "m": model, "s": statistics, "d": dense, "t": successor_db,
                     "a": self.automaton, "o": self.outputs, "h": self.head}
        self.databases: list[tuple[str, DraftDatabase]] = [
            (SOURCE_NAMES[letter], available[letter]) for letter in self.config.order if available[letter] is not None
        ]
        self.dense = dense if "d" in self.config.order else None
        self.wants_hidden = self.dense is not None or self.head is not None
        self._leaders = {SOURCE_NAMES[letter] for letter in self.config.lead}
        self._proposed_length = 0
        self._prompt_length = 0
        self.cost = ContextCost.of(cost or linear_cost)
        self.acceptance = AcceptanceModel([name for name, _ in self.databases], prior=self.config.prior,
                                          credit=self.config.credit)
        self._scored: ScoredTree | None = None
        self._shared = (0, 0.0)  # other generations' rows and expected tokens in the same forward
        self._backoff = ExplorationBackOff(self.config.explore_every) if self.config.explore_every else None
        self._exploring = False
        self._head_gate = ExplorationBackOff(1, most=self.config.h_gate)
        self._head_asked = False
        self._others_draft_ms = 0.0  # what the other generations in the same forward spent drafting
        #: whether a batched step searches at all (``search_gate``; ``None`` off, on a fixed tree or without a curve
        #: in milliseconds)
        self.search_gate = (RetrievalGate() if self.config.search_gate and self.config.tree == "scored"
                            and self.cost.milliseconds else None)
        #: which databases a step searches (``source_gate``; ``None`` off, on a fixed tree or without a curve in
        #: milliseconds), and this step's searches' milliseconds by database
        self.source_gate = (SourceGate(self.sources) if self.config.source_gate and self.config.tree == "scored"
                            and self.cost.milliseconds else None)
        self._source_ms: dict[str, float] = {}
        self._searched: tuple[float, int] | None = None  # this step's search: milliseconds, tree rows
        self._searches = 0  # searches in this generation (its first feeds the prompt to the context's indexes)

    @property
    def sources(self) -> list[str]:
        """Names of the databases this drafter reads, in access order."""
        return [name for name, _ in self.databases]

    def problems(self) -> list[str]:
        return [self.learning.problem] if self.learning is not None and self.learning.problem else []

    def describe(self) -> dict:
        stores = {name: str(db.directory) for name, db in self.databases if hasattr(db, "directory")}
        return {**super().describe(), "databases": self.sources, "stores": stores}

    def begin(self, prompt: np.ndarray) -> None:
        self._prompt_length = int(prompt.shape[0])
        self.acceptance.reset_calibration()
        self._scored = None
        self._searched, self._searches = None, 0
        if self.source_gate is not None:
            self.source_gate.begin()  # a store's first search in a process touches its pages (statistics: ~200 ms)
        self.context_db.reset()
        self.context_db.feed_context(prompt)
        for database in (self.automaton, self.outputs, self.head):
            if database is not None:
                database.reset()
        if self.dense is not None:
            self.dense.reset()

    def observe_hidden(self, hidden: np.ndarray) -> None:
        if self.dense is not None:
            self.dense.set_query(hidden)
        if self.head is not None:
            self.head.set_query(hidden)

    def share_forward(self, rows: int, tokens: float, draft_ms: float = 0.0) -> None:
        self._shared = (int(rows), float(tokens))
        self._others_draft_ms = float(draft_ms)

    def report(self) -> dict:
        report = self.dense.report() if self.dense is not None else {}
        if self.config.tree == "scored":
            report["acceptance_calibration"] = self.acceptance.calibration_counts()
        if self.source_gate is not None:
            report["source_gate"] = self.source_gate.report()
        return report

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        root = int(context[-1])
        self._proposed_length = context.shape[0]
        if budget <= 0:
            return root_only(root)
        if self.config.tree == "scored":
            cost = self.cost.at(context.shape[0])
            self._searched = None
            batched = self._shared[0] > 0
            if batched and self.search_gate is not None and not self.search_gate.pays(cost, *self._shared,
                                                                                       self._others_draft_ms):
                return root_only(root)
            started = time.perf_counter()
            candidates = self.candidates(context)
            self._scored = select_tree(root, candidates, self.acceptance, cost, budget, self._shared)
            if self._scored.tree.size == 1 and candidates and self._due_to_explore():
                # the single node with the best estimate, whatever the cost curve says
                self._scored = select_tree(root, candidates, self.acceptance, _flat_cost, 1)
                self._exploring = True
            if self._head_asked:
                self._head_gate.record(found=self.head_source in self._scored.tree.sources[1:])
                self._head_asked = False
            self._searches += 1
            if self.search_gate is not None and self._searches > 1:
                self._searched = (1e3 * (time.perf_counter() - started), self._scored.tree.size)
            return self._scored.tree
        sequences, sources = self.collect(context)
        return build_tree(root, sequences, sources, budget=min(budget, self.config.n * self.config.m))

    head_source = SOURCE_NAMES["h"]

    def _head_due(self) -> bool:
        """Whether to ask the head this step (``h_gate``'s back-off; ``tree=fixed`` asks every step)."""
        if self.config.tree != "scored":
            return True
        if not self._head_gate.tick():
            return False
        self._head_asked = True
        return True

    def _due_to_explore(self) -> bool:
        """Count one more empty step; True (and the count restarts) when an exploration is due."""
        if self._backoff is None:
            return False
        return self._backoff.tick()

    def candidates(self, context: np.ndarray) -> list[Candidate]:
        """Up to ``candidates`` sequences from every database, with confidence bins: each database's own evidence
        where it has some (shares of counts), else the sequence's rank. The head is asked only when
        :meth:`_head_due` says so."""
        out = []
        self._source_ms = {}
        for name, database in self.databases:
            if self.source_gate is not None and not self.source_gate.due(name):
                continue
            if database is self.head and not self._head_due():
                continue
            started = time.perf_counter()
            scored = getattr(database, "retrieve_scored", None)
            found = scored(context, self.config.candidates) if scored is not None else [
                (seq, rank) for rank, seq in enumerate(database.retrieve(context, self.config.candidates))]
            self._source_ms[name] = 1e3 * (time.perf_counter() - started)
            longest_match = database is self.automaton or database is self.outputs
            length = self.config.a_len if longest_match else self.config.m
            for seq, confidence in found:
                tokens = (tuple(seq[:length].tolist()) if isinstance(seq, np.ndarray)
                          else tuple(map(int, seq[:length])))
                if tokens:
                    out.append(Candidate(tokens, name, confidence))
        return out

    def _account_searches(self, verdict: Verdict) -> None:
        """Tell the source gate what this step's searches took and what their accepted tokens saved."""
        if self.source_gate is None or not self._source_ms:
            return
        accepted = Counter(verdict.accepted_sources)
        token_ms = self.cost.at(self._proposed_length)(1)
        for name, ms in self._source_ms.items():
            self.source_gate.searched(name, ms, accepted.get(name, 0), token_ms)
        self._source_ms = {}

    def collect(self, context: np.ndarray) -> tuple[list[np.ndarray], list[str]]:
        """Hierarchical access: draft sequences and their source names, at most ``n``, in priority order.

        Databases are read in order and later ones only while fewer than ``n`` sequences are collected. A sequence
        equal to (or a prefix of) one already collected adds no node to the tree and is skipped. If no database of
        ``lead`` contributed, the step drafts nothing.
        """
        sequences: list[np.ndarray] = []
        sources: list[str] = []
        for name, database in self.databases:
            wanted = self.config.n - len(sequences)
            if wanted <= 0:
                break
            for seq in database.retrieve(context, wanted):
                seq = np.asarray(seq, dtype=np.int64)[: self.config.m]
                if seq.shape[0] and not any(is_prefix(seq, kept) for kept in sequences):
                    sequences.append(seq)
                    sources.append(name)
                    if len(sequences) == self.config.n:
                        break
        if not self._leaders.intersection(sources):
            return [], []
        return sequences, sources

    def observe(self, verdict: Verdict, context: np.ndarray) -> None:
        if self._scored is not None and verdict.tree is self._scored.tree:
            if self._searched is not None:
                self.search_gate.record(*self._searched, len(verdict.path) + 1)
                self._searched = None
            self.acceptance.learn(self._scored, verdict)
            self._account_searches(verdict)
            if self._scored.tree.size > 1 and self._backoff is not None:
                self._backoff.restart()  # the empty steps in a row start again
            if self._exploring:
                self._exploring = False
                self._backoff.record(found=bool(verdict.path))
        if self.successors is not None and verdict.target_topk is not None:
            self.successors.update(verdict.tree.tokens, verdict.target_topk)
        self.recycle(verdict, context[: self._proposed_length])
        self.context_db.feed_context(context)

    def learned(self) -> dict:
        """The acceptance rates, the databases' search gates and the head's and the exploration's back-offs, with the
        databases they were learned for."""
        return {"sources": self.sources, "acceptance": self.acceptance, "source_gate": self.source_gate,
                "search_gate": self.search_gate, "head_gate": self._head_gate, "backoff": self._backoff}

    def resume(self, learned: object) -> None:
        """Start from another drafter's :meth:`learned` if it read the same databases (a store added or removed
        since makes it start afresh)."""
        if not isinstance(learned, dict) or learned.get("sources") != self.sources:
            return
        self.acceptance = learned["acceptance"]
        # the learned rates carry over; how they start and are credited is this drafter's own setting
        self.acceptance.prior, self.acceptance.credit = self.config.prior, self.config.credit
        self._head_gate = learned["head_gate"]
        for name, kept in (("source_gate", learned["source_gate"]), ("search_gate", learned["search_gate"])):
            if getattr(self, name) is not None and kept is not None:
                setattr(self, name, kept)
        if self._backoff is not None and learned["backoff"] is not None:
            self._backoff = learned["backoff"]

    def finish(self, context: np.ndarray) -> None:
        """Add this generation's output to the earlier outputs (``o``); with a learning store, queue it (the key's
        context, then every generated token) and write a new version every ``flush_every`` generations."""
        if self.outputs is not None:
            self.outputs.recent.add(np.asarray(context[self._prompt_length :]).tolist())
        if self.learning is None:
            return
        start = max(0, self._prompt_length - self.learning.table.key_len)
        self.learning.add_generation(np.asarray(context[start:]))
        if self.learning.pending >= self.config.flush_every:
            self.learning.flush()

    def recycle(self, verdict: Verdict, before: np.ndarray) -> None:
        """Add the target's predictions at tree nodes off the accepted path to the context database.

        For node ``i`` the key is the last ``l`` tokens of the context extended by the path to ``i``; the value is
        the target's top-1 after ``i``, continued while the tree holds that token as a child (its prediction there
        is known too). With ``recycle_topk = k > 1`` the next ``k - 1`` predictions become one-token values.
        On-path predictions are skipped: they are the committed tokens, fed from the context.
        """
        tree, l, m = verdict.tree, self.config.l, self.config.m
        on_path = set(verdict.path)
        on_path.add(0)
        argmax = verdict.target_argmax
        topk = verdict.target_topk
        tail = before[-l:].tolist()
        tokens = tree.tokens.tolist()
        parents = tree.parents.tolist()
        keys: list[tuple[int, ...]] = [tuple(tail)]  # key after each node, in BFS order (parents come first)
        for i in range(1, tree.size):
            keys.append((keys[parents[i]] + (tokens[i],))[-l:])
        for i in range(tree.size):
            if len(keys[i]) < l:
                continue
            if i not in on_path:
                self.context_db.add(keys[i], self._greedy_chain(tree, argmax, i, m))
            if topk is not None:
                for token in topk[i, 1:].tolist():
                    self.context_db.add(keys[i], (token,))

    @staticmethod
    def _greedy_chain(tree: DraftTree, argmax: np.ndarray, node: int, m: int) -> tuple[int, ...]:
        chain = [int(argmax[node])]
        child = tree.children(node).get(chain[-1])
        while child is not None and len(chain) < m:
            chain.append(int(argmax[child]))
            child = tree.children(child).get(chain[-1])
        return tuple(chain)


def _flat_cost(rows: int) -> float:
    """A cost curve on which every node pays (exploration)."""
    return 1.0


def _open_head(directory: str, target) -> HeadStore:
    """A draft head for ``target``, its products on the target's int4 kernels when it runs on them."""
    store = HeadStore.open(directory, target)
    store.use_kernels(target.int4_kernels())
    return store


@register("hd", HierarchyConfig, summary="Hierarchy Drafting: context, model, statistics, successor (and dense) "
                                         "databases; the default", sizes_itself=True)
def build_hierarchy(options: HierarchyConfig, written: dict[str, str], context) -> Drafter:
    """``hd``: the databases its ``order`` names — the context database always, the model, suffix and dense stores
    given with ``--datastore`` or found at the default place, the successor table (kept in the learning store with
    ``learn=true``) — scored against the target's cost curve; with a draft model (``draft=M``, or ``draft=on`` and
    ``--draft-model``), pre-verified and continued by it."""
    from hierspec.datastore.dense import DenseStore

    fingerprint, name = context.fingerprint()
    model_dir = context.optional_datastore("model") if "m" in options.order else None
    suffix_dir = context.optional_datastore("suffix") if "s" in options.order else None
    dense_dir = context.optional_datastore("dense") if "d" in options.order else None
    head_dir = context.optional_datastore("head") if "h" in options.order else None
    model = statistics = dense = None
    if model_dir:
        table = context.shared(("ngram", model_dir, options.top_k),
                               lambda: NgramTable.open(model_dir, fingerprint, name, top_k=options.top_k))
        model = ModelDatabase(table, options.min_count, options.m_min_share)
    if suffix_dir:
        store = context.shared(("suffix", suffix_dir), lambda: SuffixStore.open(suffix_dir, fingerprint, name))
        statistics = StatisticsDatabase(store, options.m, n_min=options.s_n_min, k=options.s_k,
                                        min_share=options.s_min_share)
    if dense_dir:
        dense = DenseRetriever(context.shared(("dense", dense_dir), lambda: DenseStore.open(dense_dir, context.target)),
                               DenseConfig(k=options.d_k, min_score=options.d_min_score))
    learning = successors = None
    if options.learn:
        learning = context.learning_store(model_dir, options.top_k, options.t_k)
    elif "t" in options.order:
        # learned from every generation's verdicts; concurrent generations of the same method share one table (a
        # benchmark's methods do not: each learns from its own generations only)
        successors = context.shared(("successors", options),
                                    lambda: SuccessorTable(context.target.vocab_size, options.t_k))
    outputs = (context.shared(("recent-outputs", options), lambda: RecentOutputs(options.o_max_tokens))
               if "o" in options.order else None)
    head = context.shared(("head", head_dir), lambda: _open_head(head_dir, context.target)) if head_dir else None
    drafter = HierarchyDrafter(options, model, statistics, dense, cost=context.verification_cost(),
                               successors=successors, learning=learning, outputs=outputs, head=head,
                               embeddings=context.target.input_embeddings() if head is not None else None)
    draft = draft_model_of(options.draft, context.draft_model)
    log.info("hd reads %s%s", " > ".join(drafter.sources), f", pre-verified by {draft}" if draft else "")
    return drafter if draft is None else pre_verified(drafter, context.load_draft_lm(draft, "hd"),
                                                      context.verification_cost(), defer=options.defer)


def draft_model_of(option: str, from_cli: str | None) -> str | None:
    """The draft model ``hd``'s ``draft=`` option names: ``off`` → ``None``, ``auto`` → the command line's
    ``--draft-model`` or ``None``, ``on`` → the command line's ``--draft-model`` (an error without one), anything
    else → itself."""
    if option == "off":
        return None
    if option == "auto":
        return from_cli or None
    if option == "on":
        if not from_cli:
            raise InputError("hd:draft=on reads the draft model from --draft-model, and none was given")
        return from_cli
    return option
