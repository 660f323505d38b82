"""Windows for drafters that pay per drafted token: the expected-tokens-per-millisecond rule, read with each
token's own confidence.

A draft model (``sd``) or HSDDW's middle model drafts one token (or one round) at a time and knows the probability
its drafting distribution gave each token. Tokens it is sure of are accepted far more often than the average, so
the cost-aware plan's one acceptance rate per depth (:mod:`hierspec.drafters.cost_aware`), averaged over sure and
unsure tokens, stops long confident runs too early (HSDDW on Qwen2.5-Coder-1.5B: 1.30x cost-aware, 1.58x with the
paper's window). :class:`TokenWindow`:

* estimates each drafted token's chance of acceptance from its confidence: decayed acceptance counts in
  :data:`BUCKETS` confidence buckets, each starting from its bucket's confidence (a calibrated draft) as prior;
* after each token or round, lets drafting go on only while one more token as sure as the last is expected to
  raise the step's tokens per millisecond (drafting and verification, from the cost curves). With a constant
  chance the ratio rises then falls, so this one-token look-ahead stops where it peaks;
* learns from each verdict: the tokens up to and including the first rejected one (later ones say nothing).

Whether to draft past a token reads the tokens drafted so far, never a later one, so a chain's length is a stopping
time of the draft and speculative sampling stays exact (as with HSDDW's entropy stop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

#: confidence buckets of equal width over [0, 1]
BUCKETS = 10
#: weight, in trials, of a bucket's prior (its own confidence)
_PRIOR_TRIALS = 2.0


class ConfidenceRates:
    """How often drafted tokens of each confidence were accepted (decayed counts with a calibrated prior)."""

    def __init__(self, buckets: int = BUCKETS, decay: float = 0.995) -> None:
        self.decay = decay
        self._prior = (np.arange(buckets) + 0.5) / buckets
        self._hits = np.zeros(buckets)
        self._trials = np.zeros(buckets)

    def bucket(self, confidence: float) -> int:
        """The bucket of a confidence in [0, 1]."""
        return min(max(int(confidence * len(self._prior)), 0), len(self._prior) - 1)

    def rate(self, confidence: float) -> float:
        """Estimated chance that a drafted token of this confidence is accepted."""
        b = self.bucket(confidence)
        return float((self._hits[b] + _PRIOR_TRIALS * self._prior[b]) / (self._trials[b] + _PRIOR_TRIALS))

    def record(self, confidences: Sequence[float], accepted: int) -> None:
        """One verified chain: its first ``accepted`` tokens passed, the next one (if drafted) was rejected."""
        self._hits *= self.decay
        self._trials *= self.decay
        for i, confidence in enumerate(confidences[: accepted + 1]):
            b = self.bucket(confidence)
            self._trials[b] += 1
            self._hits[b] += i < accepted

    def keep(self, weight: float) -> None:
        """Scale the counts (a new generation keeps part of what earlier ones taught)."""
        self._hits *= weight
        self._trials *= weight


def best_case_speedup(verify_ms: Callable[[int], float], draft_ms: Callable[[int], float], deepest: int,
                      acceptance: float = 1.0) -> float:
    """How many times faster than plain decoding a draft of up to ``deepest`` tokens decodes at best if each token it
    drafts is accepted with chance ``acceptance`` (1: every one): the best ``(1 + a + … + a^d) c(1) / (δ(d) +
    c(1 + d))`` over ``d = 1..deepest`` (``c``: ``verify_ms`` by rows, ``δ``: ``draft_ms`` by tokens); 1 for
    ``deepest < 1``."""
    plain = verify_ms(1)
    expected = np.cumsum(acceptance ** np.arange(deepest + 1, dtype=np.float64))  # tokens of a step, by depth
    return max([float(expected[d]) * plain / (draft_ms(d) + verify_ms(1 + d)) for d in range(1, deepest + 1)],
               default=1.0)


class TokenWindow:
    """The per-step window of a drafter that drafts token by token.

    The cost-aware wrapper calls :meth:`start` before each proposal and :meth:`learn` after its verdict; the drafter
    calls :meth:`add` for each token it drafts and :meth:`worth_more` before drafting further.

    Args:
        verify_ms: milliseconds of a verification forward of ``rows`` nodes (root included).
        draft_ms: milliseconds the drafter spends on ``tokens`` draft tokens.
    """

    def __init__(self, verify_ms: Callable[[int], float], draft_ms: Callable[[int], float]) -> None:
        self.verify_ms = verify_ms
        self.draft_ms = draft_ms
        self.rates = ConfidenceRates()
        self.stops = 0  # proposals this rule ended (counted per generation by the wrapper's report)
        self.start()

    def start(self, rows: int = 0, tokens: float = 0.0) -> None:
        """A new proposal; other generations verified in the same forward hold ``rows`` rows and are expected to add
        ``tokens`` tokens."""
        self._rows = rows
        self.confidences: list[float] = []
        self._expected = 1.0 + tokens  # the bonus token, and the other generations' tokens
        self._survival = 1.0  # chance that every token so far is accepted
        self._last = 0.0

    def add(self, confidence: float) -> None:
        """A drafted token whose drafting distribution gave it probability ``confidence``."""
        self._last = self.rates.rate(confidence)
        self._survival *= self._last
        self._expected += self._survival
        self.confidences.append(float(confidence))

    def worth_more(self) -> bool:
        """Whether one more token, as likely to pass as the last, raises the expected tokens per millisecond."""
        n = len(self.confidences)
        more = (self._expected + self._survival * self._last) / self._ms(n + 1)
        if more > self._expected / self._ms(n):
            return True
        self.stops += 1
        return False

    def learn(self, drafted: int, accepted: int) -> None:
        """The verdict on this proposal: of its first ``drafted`` tokens (those verified), ``accepted`` passed."""
        self.rates.record(self.confidences[:drafted], accepted)

    def _ms(self, tokens: int) -> float:
        return self.draft_ms(tokens) + self.verify_ms(self._rows + 1 + tokens)
