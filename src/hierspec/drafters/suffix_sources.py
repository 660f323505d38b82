"""Two draft sources of Hierarchy Drafting found by longest suffix match (SAM-Decoding, SuffixDecoding):

* ``a`` — :class:`AutomatonDatabase`: this generation's prompt and committed tokens in a suffix automaton; drafts
  what followed earlier occurrences of the context's longest repeated suffix and of its shorter suffixes.
* ``o`` — :class:`OutputsDatabase`: the same over the earlier outputs of this process
  (:class:`~hierspec.datastore.recent_outputs.RecentOutputs`, shared by every generation).

Both rank by match length, the evidence those papers found predictive: a continuation's confidence bin is its
match length's bin, so the scored tree learns acceptance per source × match length × depth. ``match_depth`` caps a
draft at that many tokens per matched token (SuffixDecoding's α).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hierspec.datastore.recent_outputs import OutputsCursor, RecentOutputs
from hierspec.datastore.suffix_automaton import SuffixAutomaton


def match_bin(length: int) -> int:
    """Confidence bin of a continuation after a match of ``length`` tokens: 8+ → 0, 4–7 → 1, 2–3 → 2, 1 → 3."""
    return 0 if length >= 8 else 1 if length >= 4 else 2 if length >= 2 else 3


def capped(tokens: tuple[int, ...], matched: int, match_depth: float) -> tuple[int, ...]:
    """``tokens`` cut to ``match_depth`` per matched token (at least one); ``match_depth`` 0 keeps them all."""
    if match_depth <= 0:
        return tokens
    return tokens[: max(1, int(match_depth * matched))]


@dataclass
class AutomatonDatabase:
    """``a``: continuations of the context's longest repeated suffix within the context itself."""

    value_len: int
    min_match: int = 1
    match_depth: float = 0.0
    automaton: SuffixAutomaton = field(default_factory=SuffixAutomaton)

    def reset(self) -> None:
        """Forget the text (a new generation starts)."""
        self.automaton = SuffixAutomaton()

    def feed(self, context: np.ndarray) -> None:
        """Append the context's tokens the automaton has not seen (the whole context if it is not an extension)."""
        if context.shape[0] < len(self.automaton):
            self.reset()
        self.automaton.extend_many(context[len(self.automaton) :].tolist())

    def retrieve_scored(self, context: np.ndarray, limit: int) -> list[tuple[tuple[int, ...], int]]:
        self.feed(context)
        found = self.automaton.continuations(limit, self.value_len, self.min_match)
        return [(capped(tokens, matched, self.match_depth), match_bin(matched)) for tokens, matched in found]

    def retrieve(self, context: np.ndarray, limit: int) -> list[tuple[int, ...]]:
        return [tokens for tokens, _ in self.retrieve_scored(context, limit)]


@dataclass
class OutputsDatabase:
    """``o``: continuations of the context's longest suffix found in earlier outputs of this process."""

    recent: RecentOutputs
    value_len: int
    min_match: int = 2
    match_depth: float = 0.0
    cursor: OutputsCursor = field(default_factory=OutputsCursor)

    def reset(self) -> None:
        """Forget the running match (a new generation starts)."""
        self.cursor.reset()

    def retrieve_scored(self, context: np.ndarray, limit: int) -> list[tuple[tuple[int, ...], int]]:
        found = self.recent.continuations(self.cursor, context, limit, self.value_len, self.min_match)
        return [(capped(tokens, matched, self.match_depth), match_bin(matched)) for tokens, matched in found]

    def retrieve(self, context: np.ndarray, limit: int) -> list[tuple[int, ...]]:
        return [tokens for tokens, _ in self.retrieve_scored(context, limit)]
