"""Which of `hd`'s databases to search in a step: each one's search time against the time its tokens save.

A database's search costs milliseconds every step, whether or not its candidates make it into the tree and are
accepted; a token it supplies that the target accepts saves about one target step, less what the rows verifying
its tree added to the forward where the tree is that database's alone (a retrieval method's, counted by
:class:`~hierspec.drafters.cost_aware.CostAwareDrafter`; ``hd``'s rows are shared by its databases and priced by
its scored tree instead). Where the target's step is cheap
(SmolLM2's one-token forward ~5 ms on the integer products), a database searched in ~1.5 ms that supplies an
accepted token once in twenty steps costs more than it saves (BENCHMARKS.md, "Forty-fourth session": `hd` 1.029x
`ar` with the ShareGPT statistics store and the draft head, 1.164x without them); on a 1.5B target's 60 ms step the
same search pays.

:class:`SourceGate` keeps, per database, decayed means of its search time and of the milliseconds its accepted
tokens saved per search. After ``warmup`` searches, a database whose savings fall below its time is searched only
every ``interval`` steps (:class:`~hierspec.drafters.exploration.ExplorationBackOff`: the interval doubles, up to
``most``, after each search that still does not pay, and returns to every step after one that does), so a database
that starts paying again (a prompt it matches) is found again within ``most`` steps.

A database whose search costs at most :data:`NEGLIGIBLE` of a target step is never gated: skipping it saves nothing
measurable, while its accepted tokens are often credited to another database that offered the same ones first (on
65 dev questions SmolLM2's successor table, ~0.01 ms a search, was gated for most of the run: 200 tokens drafted,
against ~1,000-2,300 on 26 questions in runs where it stayed open).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hierspec.drafters.exploration import ExplorationBackOff

#: the weight of the newest search in the decayed means
DECAY = 0.1
#: searches of a database before its means decide anything
WARMUP = 16
#: the longest interval between two searches of a database that does not pay
MOST_STEPS_BETWEEN = 32
#: a database whose mean search takes at most this share of a target step is searched every step
NEGLIGIBLE = 0.01


@dataclass
class _Record:
    searches: int = 0
    ms: float = 0.0  # decayed mean search time
    saved: float = 0.0  # decayed mean milliseconds its accepted tokens saved per search
    token_ms: float = 0.0  # the target's one-token step at the last search
    backoff: ExplorationBackOff = field(default_factory=lambda: ExplorationBackOff(1, most=MOST_STEPS_BETWEEN))

    def pays(self) -> bool:
        return self.saved >= self.ms or self.ms <= NEGLIGIBLE * self.token_ms


class SourceGate:
    """Per-database search gate (see the module docstring); databases are named as the drafter names its sources."""

    #: databases whose next search is not counted (:meth:`begin`); a class default for gates kept by older versions
    _uncounted: frozenset[str] = frozenset()

    def __init__(self, names: Iterable[str], warmup: int = WARMUP, decay: float = DECAY) -> None:
        self.warmup = warmup
        self.decay = decay
        self._records = {name: _Record() for name in names}

    def begin(self) -> None:
        """A new generation: each database's next search is not counted. It reads the prompt into per-generation
        indexes, and a process's first touches a store's pages (REST over Qwen2.5-Coder-1.5B's code store: 141 ms,
        then 0.03-5 ms); in the decayed mean such a search would price the database out for hundreds of steps."""
        self._uncounted = frozenset(self._records)

    def due(self, name: str) -> bool:
        """Whether to search ``name`` this step (a skipped step counts towards its next search)."""
        record = self._records[name]
        return record.searches < self.warmup or record.pays() or record.backoff.tick()

    def searched(self, name: str, ms: float, accepted: int, token_ms: float, rows_ms: float = 0.0) -> None:
        """Account one search of ``name``: it took ``ms``, and ``accepted`` of the tokens it supplied were accepted,
        each saving ``token_ms`` (the target's one-token step), while verifying them added ``rows_ms`` to the step
        (where the database's tree is the step's alone; 0 where the rows are shared with other databases); a
        database's first search after :meth:`begin` is not counted."""
        if name in self._uncounted:
            self._uncounted = self._uncounted - {name}
            return
        record = self._records[name]
        record.token_ms = token_ms
        saved = accepted * token_ms - rows_ms
        if record.searches == 0:
            record.ms, record.saved = ms, saved
        else:
            record.ms += self.decay * (ms - record.ms)
            record.saved += self.decay * (saved - record.saved)
        record.searches += 1
        if record.searches >= self.warmup:
            record.backoff.record(found=record.pays())

    def report(self) -> dict[str, dict[str, float]]:
        """Each database's searches, mean search and saved milliseconds, and current interval."""
        return {name: {"searches": r.searches, "ms": round(r.ms, 4), "saved_ms": round(r.saved, 4),
                       "interval": r.backoff.interval if r.searches >= self.warmup and not r.pays() else 1}
                for name, r in self._records.items()}
