"""What a method's drafters learned, carried from one generation to the next.

The Python API's :func:`~hierspec.generate` and :func:`~hierspec.stream` build a new drafter for every call
(:func:`~hierspec.methods.make_drafter`), so what a drafter learns from verdicts — ``hd``'s acceptance rates per
source, confidence and depth, which databases' searches pay, the draft head's back-off; the cost-aware wrapper's
acceptance by depth and its token window's rates — started from the prior on every call, where the benchmark keeps
one drafter per method across its questions (and the batch scheduler, the server's, reuses its drafters). On
39 dev questions (SmolLM2, 128 tokens, BENCHMARKS.md, "Fifty-second session") a drafter per generation gave ``hd``
1.078x ``ar`` (MAT 1.83) and one kept across them 1.155x (MAT 1.96).

:class:`CarriedState` holds the latest snapshot of one method's learning (one per
:class:`~hierspec.methods.DrafterContext` and method): a new drafter starts from a copy of it
(:meth:`~hierspec.drafters.base.Drafter.resume`) and leaves a copy of its own when its generation ends
(:meth:`~hierspec.drafters.base.Drafter.learned`). Concurrent generations each start from the latest that finished
and never share anything mutable; stores and what learns into them (the successor table) are shared as before.
Greedy outputs never depend on it (any tree is verified losslessly), nor do sampled ones of deterministic drafts
(each token is one draw from the target's distribution, whatever the tree).
"""

from __future__ import annotations

import copy
import threading
from typing import Any


class CarriedState:
    """The latest snapshot a finished generation of one method left, for the next drafter of that method."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: Any = None

    def latest(self) -> Any:
        """A copy of the latest snapshot, or ``None`` before any generation of the method finished."""
        with self._lock:
            state = self._state
        return copy.deepcopy(state)

    def leave(self, state: Any) -> None:
        """Keep a copy of ``state`` (a finished drafter's :meth:`~hierspec.drafters.base.Drafter.learned`) as the
        latest; ``None`` keeps the one before."""
        if state is None:
            return
        snapshot = copy.deepcopy(state)
        with self._lock:
            self._state = snapshot
