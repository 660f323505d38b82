"""Incremental detokenization with stop strings, for streaming text as tokens are accepted."""

from __future__ import annotations

from collections.abc import Callable, Sequence

_INCOMPLETE_CHAR = "\ufffd"


class TextAssembler:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Text is only released once it can no longer change: a trailing replacement character (an incomplete UTF-8
    sequence split across tokens) and any tail that could still grow into a stop string are held back.

    Example: with stop ``["\\n\\n"]``, feeding tokens whose text is ``"Hi\\n"`` releases ``"Hi"`` (the newline might
    start the stop string); feeding more text ``"\\nBye"`` ends the stream with nothing more released.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._released = 0
        self.text = ""
        self.stopped = False

    @property
    def token_ids(self) -> list[int]:
        """All ids fed so far."""
        return list(self._ids)

    def feed(self, ids: Sequence[int]) -> str:
        """Add accepted tokens; return the newly releasable text. Sets :attr:`stopped` when a stop string appears."""
        if self.stopped:
            return ""
        self._ids.extend(int(t) for t in ids)
        full = self._decode(self._ids)
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            self.text = full[:cut]
            return self._release(len(self.text))
        self.text = full
        return self._release(self._safe_end(full))

    def finish(self) -> str:
        """Release whatever is held back at the end of generation."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self._released:
            return ""
        delta = self.text[self._released : end]
        self._released = end
        return delta

    def _first_stop(self, text: str) -> int | None:
        positions = [p for p in (text.find(s, max(0, self._released - len(s))) for s in self._stop) if p >= 0]
        return min(positions) if positions else None

    def _safe_end(self, text: str) -> int:
        end = len(text)
        while end > self._released and text[end - 1] == _INCOMPLETE_CHAR:
            end -= 1
        hold = 0
        for stop in self._stop:
            for keep in range(min(len(stop) - 1, end - self._released), 0, -1):
                if text[end - keep : end] == stop[:keep]:
                    hold = max(hold, keep)
                    break
        return end - hold
