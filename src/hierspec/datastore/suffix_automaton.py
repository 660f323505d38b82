"""An online suffix automaton over a token stream: longest earlier match of the text's suffix in amortised O(1).

A suffix automaton (Blumer et al.) has one state per class of substrings sharing their end positions; ``extend``
appends one token in amortised constant time. The extension itself finds the text's longest suffix that occurred
before (the first state on the old last state's suffix-link chain with a transition on the new token), so the
automaton tracks that match as it is built, with no re-scan: :attr:`SuffixAutomaton.repeat_length` and an earlier
end position of it. :meth:`SuffixAutomaton.continuations` reads what followed earlier occurrences of that match
and of its shorter suffixes (longest first), each with its match length — the evidence SAM-Decoding and
SuffixDecoding score drafts by.

Every state keeps one end position of its strings: where it was created, then the latest position at which the
text's repeat landed in it. It is always a true occurrence (all strings of a state share their end positions), and
usually the most recent one, but not always (a later occurrence matched through a longer state does not update the
shorter states above it).

:meth:`SuffixAutomaton.advance` matches another stream against a fixed automaton (the text of earlier outputs),
also amortised O(1) per token.

Example: after ``[5, 6, 7, 9, 5, 6]`` the repeat is ``[5, 6]`` (length 2), ending earlier at position 1, and its
continuation is ``[7, 9, 5]``.
"""

from __future__ import annotations

from collections.abc import Iterable


class SuffixAutomaton:
    """The suffix automaton of a growing token sequence, with its longest repeated suffix kept current."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._next: list[dict[int, int]] = [{}]
        self._link = [-1]
        self._len = [0]
        self._end = [-1]
        self._last = 0
        self._repeat = 0  # state holding the longest suffix that occurred earlier (0: none)
        self._repeat_end = -1  # an earlier end position of it

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def repeat_length(self) -> int:
        """Length of the text's longest suffix that also ends at an earlier position (0 if none)."""
        return self._len[self._repeat]

    @property
    def repeat_end(self) -> int:
        """An earlier end position of that suffix (``-1`` when there is none)."""
        return self._repeat_end

    def extend_many(self, tokens: Iterable[int]) -> None:
        """Append every token, in order."""
        for token in tokens:
            self.extend(int(token))

    def extend(self, token: int) -> None:
        """Append one token (amortised O(1)) and update the longest repeated suffix."""
        position = len(self.tokens)
        self.tokens.append(token)
        current = self._new_state(self._len[self._last] + 1, position)
        state = self._last
        while state != -1 and token not in self._next[state]:
            self._next[state][token] = current
            state = self._link[state]
        if state == -1:
            self._link[current] = 0
            match = 0
        else:
            match = self._next[state][token]
            if self._len[state] + 1 != self._len[match]:
                match = self._split(state, token, match)
            self._link[current] = match
        self._last = current
        self._repeat = match
        self._repeat_end = self._end[match] if match else -1
        if match:
            self._end[match] = position  # the newest occurrence, for the next time the text lands here

    def continuations(self, limit: int, length: int, min_match: int = 1) -> list[tuple[tuple[int, ...], int]]:
        """Up to ``limit`` distinct continuations (at most ``length`` tokens each) of earlier occurrences of the
        text's suffixes, the longest match first, each with its match length. A continuation that is a prefix of
        one already returned is skipped."""
        return self.read(self._repeat, self.repeat_length, self._repeat_end, limit, length, min_match)

    def read(self, state: int, matched: int, end: int, limit: int, length: int, min_match: int = 1,
             stop: int | None = None) -> list[tuple[tuple[int, ...], int]]:
        """Continuations after ``end`` for a match of ``matched`` tokens in ``state``, then after the stored end of
        each shorter match on its suffix-link chain; a continuation stops before the token ``stop``. See
        :meth:`continuations`."""
        found: list[tuple[tuple[int, ...], int]] = []
        while state > 0 and matched >= min_match and len(found) < limit:
            following = self.tokens[end + 1 : end + 1 + length]
            if stop is not None and stop in following:
                following = following[: following.index(stop)]
            candidate = tuple(following)
            if candidate and not any(kept[: len(candidate)] == candidate for kept, _ in found):
                found.append((candidate, matched))
            state = self._link[state]
            matched, end = self._len[state], self._end[state]
        return found

    def advance(self, state: int, length: int, token: int) -> tuple[int, int]:
        """Match one more token of another stream: from ``(state, length)``, the longest suffix of that stream
        matched in this text, to the same after ``token``. Start from ``(0, 0)``."""
        while state and token not in self._next[state]:
            state = self._link[state]
            length = self._len[state]
        nxt = self._next[state].get(token)
        if nxt is None:
            return 0, 0
        return nxt, length + 1

    def end_of(self, state: int) -> int:
        """The stored end position of ``state``'s strings."""
        return self._end[state]

    def _new_state(self, length: int, end: int) -> int:
        self._next.append({})
        self._link.append(-1)
        self._len.append(length)
        self._end.append(end)
        return len(self._len) - 1

    def _split(self, state: int, token: int, target: int) -> int:
        """Clone ``target`` for the strings of length ``len(state) + 1`` (the classic construction's split)."""
        clone = self._new_state(self._len[state] + 1, self._end[target])
        self._next[clone] = dict(self._next[target])
        self._link[clone] = self._link[target]
        while state != -1 and self._next[state].get(token) == target:
            self._next[state][token] = clone
            state = self._link[state]
        self._link[target] = clone
        return clone
