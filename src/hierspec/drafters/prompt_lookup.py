"""Prompt lookup decoding: drafts copied from earlier occurrences of the current n-gram in the context."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hierspec.drafters.base import Drafter
from hierspec.drafters.registry import register
from hierspec.errors import InputError
from hierspec.tree import DraftTree, build_tree, is_prefix


@dataclass(frozen=True)
class PromptLookupConfig:
    """Shape of prompt-lookup drafts.

    Attributes:
        max_ngram: longest suffix of the context that is looked up.
        min_ngram: shortest suffix tried when longer ones have no match. The default 2 skips single-token matches:
            on a CPU a forward over several tokens costs ~1.5x a one-token step, and unigram drafts were accepted
            too rarely to pay for it (BENCHMARKS.md, PLD tuning).
        draft_len: tokens copied after each match.
        max_matches: distinct continuations merged into the tree (most recent occurrence first).
    """

    max_ngram: int = 3
    min_ngram: int = 2
    draft_len: int = 10
    max_matches: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise InputError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        if self.draft_len < 1 or self.max_matches < 1:
            raise InputError("prompt lookup needs draft_len >= 1 and max_matches >= 1")


def find_continuations(context: np.ndarray, config: PromptLookupConfig) -> list[np.ndarray]:
    """Continuations of the longest suffix n-gram of ``context`` that occurs earlier in it.

    Tries n from ``max_ngram`` down to ``min_ngram`` and stops at the first n with a match. For each earlier
    occurrence, most recent first, returns the up to ``draft_len`` tokens that followed it; duplicates and
    continuations that are prefixes of a kept one are dropped.

    Example: context ``[5, 6, 7, 9, 5, 6, 8, 1, 5, 6]`` with ``max_ngram=2``, ``draft_len=3``: the suffix ``[5, 6]``
    occurred at positions 4 and 0, giving ``[[8, 1, 5], [7, 9, 5]]``.
    """
    length = context.shape[0]
    found: list[np.ndarray] = []
    for n in range(min(config.max_ngram, length - 1), config.min_ngram - 1, -1):
        starts = _ngram_occurrences(context, n)
        for start in starts[::-1]:
            cont = context[start + n : start + n + config.draft_len]
            if not any(is_prefix(cont, kept) for kept in found):
                found.append(cont)
                if len(found) == config.max_matches:
                    return found
        if found:
            return found
    return found


def _ngram_occurrences(context: np.ndarray, n: int) -> np.ndarray:
    """Start positions ``i`` with ``context[i:i+n] == context[-n:]`` and at least one token after the match."""
    length = context.shape[0]
    candidates = length - n  # a match starting at length - n is the suffix itself
    if candidates <= 0:
        return np.empty(0, dtype=np.int64)
    suffix = context[-n:]
    hit = context[:candidates] == suffix[0]
    for j in range(1, n):
        hit &= context[j : candidates + j] == suffix[j]
    return np.flatnonzero(hit)



class PromptLookupDrafter(Drafter):
    """Drafts by copying what followed earlier occurrences of the context's last n-gram (prompt lookup)."""

    name = "pld"
    # a search reads only the context (~0.05-0.15 ms) and its hits come in runs: gated by a decayed mean of ~10
    # searches it missed the runs' starts (SmolLM2 on a Zen 1, 65 dev questions: 1.051-1.060x `ar` never gated,
    # 1.031-1.037x gated on 2,250-2,860 of ~5,800 steps)
    gated_search = False

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self.config = config or PromptLookupConfig()

    def propose(self, context: np.ndarray, budget: int) -> DraftTree:
        sequences = find_continuations(context, self.config) if budget > 0 else []
        return build_tree(int(context[-1]), sequences, sources=[self.name] * len(sequences), budget=budget)


@register("pld", PromptLookupConfig, summary="prompt lookup: n-gram matches in the prompt and output")
def build_prompt_lookup(options: PromptLookupConfig, written: dict[str, str], context) -> PromptLookupDrafter:
    """``pld:max_ngram=3,min_ngram=2,draft_len=10,max_matches=4``."""
    return PromptLookupDrafter(options)
