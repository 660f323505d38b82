"""When a draft model starts on a generation: ski rental over reading the prompt.

Before its first draft a draft model reads the whole prompt (its prefill): Qwen2.5-Coder-0.5B on 2 Xeon cores,
~1.4-1.8 ms a token, 1.75 s for a 950-token Spec-Bench RAG prompt. It pays that back only over the tokens it then
drafts, and an answer of 12-18 tokens after such a prompt never does (dev rag, Qwen2.5-Coder-1.5B: `sd` 0.79x, `hsddw`
0.81x plain decoding, the draft model's prefill ~1 s of a 4-5 s question). Whether the answer will be long is not
known when it starts, so the choice is the ski-rental problem: rent (decode without the draft model, forgoing what it
would save each step) until the rent paid equals the purchase (the prefill), then buy — never more than twice the
cost of the better choice made in hindsight. :class:`DeferredStart` prices each target step taken without the draft
model at :data:`RENT` of a target step and starts the draft model once those, with a head start of
:data:`HEAD_START` steps (answers are rarely shorter), add up to its prefill's estimate from its cost curve. A
prompt the draft can read in the same forward as its first draft (:data:`CATCH_UP_ROWS` tokens) starts it at once;
so does a draft model or a target whose cost is unknown (the old behaviour).

A step without a draft model that drafts at most ``deepest`` tokens forgoes at most what its best case saves, every
token accepted (:func:`~hierspec.drafters.token_window.best_case_speedup` ``s``: ``1 - 1/s`` of a step), so given
``deepest`` the rent is capped there. A draft barely cheaper than the target then almost never buys a prompt's
reading: SmolLM2-135M's 90 %-layer self-draft (a drafted token ~0.86 of a step, ``s`` ~1.06) started on every
prompt at the fixed rent and lost 7-14 % to plain decoding, mostly to those readings.

Deciding reads the cost curves and a step count, never a clock or a token not yet verified, so the output and a
seeded sampled generation are unchanged: a step without the draft model is verified like any other.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hierspec.draft_lm import CATCH_UP_ROWS, DraftLM
from hierspec.drafters.token_window import best_case_speedup

#: what one target step without the draft model is taken to forgo, in target steps: the saving of a 2x speed-up
#: (the draft models measured 1.4-2.3x on Qwen2.5-Coder-1.5B; a higher rent starts sooner)
RENT = 0.5
#: steps of rent counted as paid when a generation starts: answers are rarely shorter (2 of 26 dev answers of
#: Qwen2.5-Coder-1.5B had 8-9 tokens, none fewer), so a prompt whose reading that many forgone steps would pay for
#: starts the draft model at once (a 150-token HumanEval prompt: ~220 ms against 8 x 0.5 x ~65 ms) instead of
#: renting for nothing (`sd` lost 6 % on 12 HumanEval problems without this head start)
HEAD_START = 8


class DeferredStart:
    """Decides, step by step, when ``lm`` starts on a generation.

    Args:
        lm: the draft model.
        rent: share of a target step each step without the draft model is taken to forgo.
        head_start: steps of rent counted as paid from the start (:data:`HEAD_START`).
        defer: ``False``: start at once, whatever the prompt (the methods' ``defer=false``).
        deepest: the most tokens one draft of ``lm`` holds, one forward of ``lm`` each: caps the rent at what such
            a draft saves at best (HSDDW's middle model: its block, priced as that many tokens of its own);
            ``None``: the rent as given.
    """

    def __init__(self, lm: DraftLM, rent: float = RENT, head_start: int = HEAD_START, defer: bool = True,
                 deepest: int | None = None) -> None:
        if not rent > 0 or head_start < 0:
            raise ValueError("rent must be > 0 and head_start >= 0")
        if deepest is not None and deepest < 1:
            raise ValueError("deepest must be >= 1")
        self.lm = lm
        self.rent = rent
        self.head_start = head_start
        self.defer = defer
        self.deepest = deepest
        self.begin()

    def begin(self) -> None:
        """A new generation: the draft model has not started."""
        self.started = False
        self.deferred_steps = 0
        self._forgone: float | None = None  # ms of savings forgone, the head start included (set at the first step)
        self._rent_ms = 0.0  # ms forgone per step (set at the first step)

    def ready(self, context: np.ndarray, step_ms: Callable[[int], float] | None) -> bool:
        """Whether the draft model drafts at ``context``; ``step_ms``: the target's milliseconds by verified rows at
        this context (``None``: unknown, start now). Once started it stays started for the generation."""
        if self.started or step_ms is None or not self.defer:
            self.started = True
            return True
        if self._forgone is None:
            self._rent_ms = self.rent_share(step_ms) * float(step_ms(1))
            self._forgone = self.head_start * self._rent_ms
        rent = self._rent_ms
        lacking = self.lm.lacks(context)
        if lacking <= CATCH_UP_ROWS or self._forgone >= self.lm.prefill_ms(lacking):
            self.started = True
            return True
        self._forgone += rent
        self.deferred_steps += 1
        return False

    def rent_share(self, step_ms: Callable[[int], float]) -> float:
        """The share of a target step each step without the draft model is taken to forgo: :attr:`rent`, capped
        with :attr:`deepest` at ``1 - 1/s`` for the draft's best case ``s`` (nothing when it cannot gain)."""
        if self.deepest is None:
            return self.rent
        best = best_case_speedup(step_ms, lambda tokens: tokens * self.lm.step_ms, self.deepest)
        return min(self.rent, max(0.0, 1.0 - 1.0 / best))

    def ready_in(self, context: np.ndarray, window) -> bool:
        """:meth:`ready`, the target's milliseconds read from the drafter's cost-aware ``window``
        (:class:`~hierspec.drafters.token_window.TokenWindow`; ``None``: the drafter has none, start now)."""
        return self.ready(context, None if window is None else window.verify_ms)
