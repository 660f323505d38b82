"""Earlier outputs of this process, shared by every generation: a bounded text indexed by a suffix automaton.

SuffixDecoding's global tree in hierspec's terms: every finished generation's output is appended (followed by a
separator no token equals, so no match crosses two outputs), and a generation running now matches its own latest
tokens against the whole text, token by token, to draft what followed the longest match in an earlier answer.

The text is bounded: when it would exceed ``max_tokens`` the oldest outputs are dropped until half of it is left
and the automaton is rebuilt (amortised over the tokens added since the last rebuild). Every change bumps
:attr:`RecentOutputs.epoch`; a matcher whose epoch is stale re-matches its last few tokens, because states it
held may have been split or dropped. Readers and the writer take one lock (the server's generations run on its
worker thread; the bench and the Python API may share one drafter set between threads).

Nothing is written to disk: the text lives as long as the process (the learning store is the persistent one).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hierspec.datastore.suffix_automaton import SuffixAutomaton
from hierspec.errors import InputError

#: joins outputs in the text; no token id is negative, so no match contains it
SEPARATOR = -1
#: tokens re-matched after the text changed (longer matches are cut to this)
REMATCH_TOKENS = 64


class RecentOutputs:
    """The last outputs of this process (at most ``max_tokens`` tokens in all), searchable by longest match."""

    def __init__(self, max_tokens: int = 100_000) -> None:
        if max_tokens < 2:
            raise InputError("the recent-outputs text needs max_tokens >= 2")
        self.max_tokens = max_tokens
        self.epoch = 0
        self._automaton = SuffixAutomaton()  # its text: each output followed by SEPARATOR
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._automaton)

    @property
    def outputs(self) -> int:
        """Outputs held now."""
        return self._automaton.tokens.count(SEPARATOR)

    def add(self, output: Sequence[int]) -> None:
        """Append one finished output (an empty one is ignored); drop the oldest when the text is full."""
        tokens = [int(t) for t in output][-(self.max_tokens - 1):]
        if not tokens:
            return
        with self._lock:
            if len(self._automaton) + len(tokens) + 1 > self.max_tokens:
                self._rebuild(self._automaton.tokens + tokens + [SEPARATOR])
            else:
                self._automaton.extend_many(tokens + [SEPARATOR])
            self.epoch += 1

    def continuations(self, cursor: "OutputsCursor", context: Sequence[int], limit: int, length: int,
                      min_match: int = 1) -> list[tuple[tuple[int, ...], int]]:
        """Advance ``cursor`` over the context's tokens it has not matched yet (its last :data:`REMATCH_TOKENS` after
        the text changed), then return what followed the match and its shorter suffixes in earlier outputs, with
        match lengths, longest first."""
        with self._lock:
            automaton = self._automaton
            if cursor.epoch != self.epoch:
                cursor.epoch, cursor.state, cursor.length = self.epoch, 0, 0
                cursor.fed = max(0, len(context) - REMATCH_TOKENS)
            state, matched = cursor.state, cursor.length
            for token in context[cursor.fed :]:
                state, matched = automaton.advance(state, matched, int(token))
            cursor.state, cursor.length, cursor.fed = state, matched, len(context)
            return automaton.read(state, matched, automaton.end_of(state), limit, length, min_match, stop=SEPARATOR)

    def _rebuild(self, text: list[int]) -> None:
        """A new automaton over the newest whole outputs of ``text`` that fit in half the bound (the newest at
        least)."""
        starts = [0] + [i + 1 for i, token in enumerate(text[:-1]) if token == SEPARATOR]  # where each output starts
        start = next((s for s in starts if len(text) - s <= self.max_tokens // 2), starts[-1])
        self._automaton = SuffixAutomaton()
        self._automaton.extend_many(text[start:])


@dataclass
class OutputsCursor:
    """One generation's running match in :class:`RecentOutputs`: the automaton state and length of the longest
    matched suffix, the text's epoch it belongs to and how many context tokens it has read."""

    state: int = 0
    length: int = 0
    epoch: int = -1
    fed: int = 0

    def reset(self) -> None:
        """Forget the match (a new generation starts)."""
        self.state, self.length, self.epoch, self.fed = 0, 0, -1, 0
