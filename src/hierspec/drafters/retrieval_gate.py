"""Whether looking for a draft pays this step, counting the time the looking takes.

A retrieval drafter's tree is sized on the target's cost curve (:mod:`~hierspec.drafters.scored`), but the search
that finds its candidates is paid before the sizing, whatever tree comes out: ~1.5 ms a step for ``hd`` on SmolLM2,
beside a ~9 ms forward. Alone that pays for itself; in a full batch of eight it does not (the forward is shared, each
request's search is not: batched ``hd`` ran at 0.92x batched ``ar``, BENCHMARKS.md, "Nineteenth session").
``hd`` consults the gate in batched steps only: alone, skipping lost more accepted drafts than it saved (26 dev
questions: 114 tokens/s with the gate, 121 without).

:class:`RetrievalGate` keeps what a step that searched cost and gave — the median of its recent searches'
milliseconds (a generation's first search feeds the whole prompt to the per-generation indexes and is not
counted; a median also passes over a stray slow one), running means of its tree's rows and of its tokens (accepted
drafts plus the bonus token) — and lets a step search only when that beats a plain step in tokens per millisecond
of the whole forward::

    (T + tokens) / (D + search_ms + cost(R + rows))  >=  (T + 1) / (D + cost(R + 1))

with ``R`` and ``T`` the other generations' rows and expected tokens in the same forward, ``D`` the milliseconds
they spend drafting (all 0 alone). Nothing is skipped before :data:`FIRST_SEARCHES` searches are counted. A step
that skips the search verifies the root alone, which is lossless like any tree. One step in ``every`` searches
anyway (a look), so the figures follow the text; each look that confirms the skip doubles that wait (up to
``most``), one that does not resets it.

Example: searching costs 1.5 ms and gives 2.2 tokens in trees of 8 rows; a forward costs 9 ms for one row and 11 ms
for eight. Alone, 2.2 / 12.5 = 0.18 tokens/ms beats 1 / 9 = 0.11: search. Beside seven others (56 rows, 15 tokens
expected, 10.5 ms of their searches) at 20 ms for 57 rows and 22 for 64: 17.2 / 34 = 0.51 against 16 / 30.5 = 0.52:
skip.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hierspec.drafters.exploration import ExplorationBackOff

#: weight of the newest step in the running means (which start as the plain mean of the first 1 / NEWEST steps)
NEWEST = 0.1
#: searches counted before any step may skip one
FIRST_SEARCHES = 4
#: recent searches whose median is the search's cost
RECENT_SEARCHES = 15


@dataclass
class RetrievalGate:
    """Running means of the steps that searched, and the decision for the next step.

    Attributes:
        every: a look (a search whatever the figures) every this many steps that do not pay, at first.
        most: the longest wait between two looks.
    """

    every: int = 8
    most: int = 64
    rows: float = field(default=1.0, init=False)
    tokens: float = field(default=1.0, init=False)
    searched: int = field(default=0, init=False)  # steps that searched and were verified (means valid from 1)
    _looked: bool = field(default=False, init=False)  # the last search was a look after skipped steps
    _backoff: ExplorationBackOff = field(init=False)
    _recent: deque = field(init=False)

    def __post_init__(self) -> None:
        self._backoff = ExplorationBackOff(self.every, most=self.most)
        self._recent = deque(maxlen=RECENT_SEARCHES)

    @property
    def search_ms(self) -> float:
        """The median of the recent searches' milliseconds (0 before any)."""
        return statistics.median(self._recent) if self._recent else 0.0

    @property
    def wait(self) -> int:
        """Steps from one look to the next while searching does not pay."""
        return self._backoff.interval

    def pays(self, cost: Callable[[int], float], rows: int = 0, tokens: float = 0.0, draft_ms: float = 0.0
             ) -> bool:
        """Whether to search this step, on ``cost`` (milliseconds by tree rows) beside ``rows`` rows and ``tokens``
        expected tokens of other generations, which spend ``draft_ms`` drafting. Always before
        :data:`FIRST_SEARCHES` searches are counted; one step in :attr:`wait`, a look."""
        if self.searched < FIRST_SEARCHES:
            return True
        worth = self._worth(cost, rows, tokens, draft_ms)
        if self._looked:  # the look's step is in the means now: did it change the answer?
            self._backoff.record(found=worth)
            self._looked = False
        if worth:
            self._backoff.restart()
            return True
        if not self._backoff.tick():
            return False
        self._looked = True
        return True

    def _worth(self, cost: Callable[[int], float], rows: int, tokens: float, draft_ms: float) -> bool:
        searching = (tokens + self.tokens) / (draft_ms + self.search_ms + cost(rows + max(1, round(self.rows))))
        plain = (tokens + 1.0) / (draft_ms + cost(rows + 1))
        return searching >= plain

    def record(self, search_ms: float, rows: int, tokens: int) -> None:
        """A step that searched: its search's milliseconds, its tree's rows (root included) and the tokens it
        added (accepted drafts and the bonus token)."""
        self._recent.append(search_ms)
        self.searched += 1
        weight = max(NEWEST, 1.0 / self.searched)  # the plain mean of the first steps, then a running one
        self.rows += weight * (rows - self.rows)
        self.tokens += weight * (tokens - self.tokens)
