"""DReSD: dense-retrieval drafts (Gritta et al., 2025) — nearest neighbours of the target's own hidden state.

The query is the target's last hidden state at the last committed position, taken from the verification forward
that already ran (no extra forward). Its prediction there is the tree's root, so of the neighbours' stored next
tokens only those starting with the root are kept, and what follows the root becomes the drafts. The store is
:class:`~hierspec.datastore.dense.DenseStore`; the same retriever is HD's fourth database (letter ``d``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from hierspec.config import SamplingConfig
from hierspec.datastore.dense import PAD, DenseStore, set_search_effort
from hierspec.drafters.base import Drafter
from hierspec.drafters.registry import register
from hierspec.errors import InputError
from hierspec.tree import DraftTree, build_tree, is_prefix, root_only

SOURCE = "dense"


@dataclass(frozen=True)
class DenseConfig:
    """Dense retrieval settings. Draft shapes differ for greedy and sampled decoding (DReSD section 5.4: few long
    drafts when greedy, more shorter ones when sampling, where any one draft is less likely to survive).

    Attributes:
        k: neighbours retrieved per step (those not starting with the root are dropped).
        num_drafts / draft_len: the draft shape for greedy decoding.
        sampled_num_drafts / sampled_draft_len: the draft shape for sampling.
        min_score: neighbours less similar than this (cosine) are not drafted. On a CPU a draft makes verification
            ~1.5x as dear as a plain step, so only confident neighbours pay: on SmolLM2 with 22 k keys, neighbours
            above 0.7 gave about one accepted token per step drafted, those below 0.6 a third of one
            (BENCHMARKS.md). ``-1`` drafts from every neighbour, as the paper does.
        ef_search: HNSW search breadth; nprobe: IVF lists searched.
    """

    k: int = 32
    num_drafts: int = 3
    draft_len: int = 10
    sampled_num_drafts: int = 10
    sampled_draft_len: int = 10
    min_score: float = 0.75
    ef_search: int = 64
    nprobe: int = 16

    def __post_init__(self) -> None:
        if min(self.k, self.num_drafts, self.draft_len, self.sampled_num_drafts, self.sampled_draft_len,
               self.ef_search, self.nprobe) < 1:
            raise InputError("dense needs k, num_drafts, draft_len, sampled_num_drafts, sampled_draft_len, "
                             "ef_search and nprobe >= 1")
        if not -1.0 <= self.min_score <= 1.0:
            raise InputError("dense needs -1 <= min_score <= 1")


class DenseRetriever:
    """Holds the latest query hidden state and turns its neighbours into draft sequences; counts its work."""

    def __init__(self, store: DenseStore, config: DenseConfig) -> None:
        self.store = store
        self.config = config
        set_search_effort(store.index, config.ef_search, config.nprobe)
        self._query: np.ndarray | None = None
        self.reset()

    @property
    def directory(self):
        return self.store.directory

    def reset(self) -> None:
        """Forget the query and zero the counters (per generation)."""
        self._query = None
        self.queries = 0
        self.hits = 0
        self.search_seconds = 0.0

    def set_query(self, hidden: np.ndarray) -> None:
        self._query = hidden

    def sequences(self, root: int, limit: int, length: int) -> list[np.ndarray]:
        """Up to ``limit`` distinct continuations after ``root`` (``length`` tokens at most), most similar first."""
        if self._query is None or limit <= 0 or length <= 0:
            return []
        start = time.perf_counter()
        scores, rows = self.store.search(self._query, self.config.k)
        self._query = None  # a query answers one step
        self.queries += 1
        rows = rows[(scores >= self.config.min_score)]
        values = np.asarray(self.store.values[rows], dtype=np.int64).reshape(len(rows), self.store.next_tokens)
        values = values[values[:, 0] == root, 1 : 1 + length]
        out: list[np.ndarray] = []
        for row in values:
            row = row[: int(np.argmax(row == PAD))] if (row == PAD).any() else row
            if row.shape[0] and not any(is_prefix(row, kept) for kept in out):
                out.append(row)
                if len(out) == limit:
                    break
        self.hits += bool(out)
        self.search_seconds += time.perf_counter() - start
        return out

    def retrieve(self, context: np.ndarray, limit: int) -> list[np.ndarray]:
        """HD's database interface: continuations of ``context[-1]`` at full stored length."""
        return self.sequences(int(context[-1]), limit, self.store.next_tokens - 1)

    def report(self) -> dict:
        """Searches run, searches that gave a draft, and seconds spent searching (for the generation so far)."""
        return {"dense_queries": self.queries, "dense_hits": self.hits, "dense_search_s": self.search_seconds}


class DenseDrafter(Drafter):
    """Drafts the next tokens stored with the nearest neighbours of the target's hidden state (``--method dense``)."""

    name = "dense"
    wants_hidden = True

    def __init__(self, store: DenseStore, config: DenseConfig | None = None) -> None:
        self.config = config or DenseConfig()
        self.retriever = DenseRetriever(store, self.config)
        self._shape = (self.config.num_drafts, self.config.draft_len)

    def describe(self) -> dict:
        return {**super().describe(), "store": str(self.retriever.directory), "keys": self.retriever.store.size}

    def prepare(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        c = self.config
        self._shape = (c.num_drafts, c.draft_len) if sampling.greedy else (c.sampled_num_drafts, c.sampled_draft_len)

    def begin(self, prompt: np.ndarray) -> None:
        self.retriever.reset()

    def observe_hidden(self, hidden: np.ndarray) -> None:
        self.retriever.set_query(hidden)

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        root = int(context[-1])
        number, length = self._shape
        if budget <= 0:
            return root_only(root)
        sequences = self.retriever.sequences(root, number, min(length, self.retriever.store.next_tokens - 1))
        if not sequences:
            return root_only(root)
        return build_tree(root, sequences, [SOURCE] * len(sequences), budget=budget)

    def report(self) -> dict:
        return self.retriever.report()


@register("dense", DenseConfig, summary="DReSD: dense retrieval by the target's hidden state (--datastore)")
def build_dense(options: DenseConfig, written: dict[str, str], context) -> DenseDrafter:
    """``dense`` over the given dense store, which must belong to this very model."""
    path = context.datastore("dense", "dense")
    return DenseDrafter(context.shared(("dense", path), lambda: DenseStore.open(path, context.target)), options)
