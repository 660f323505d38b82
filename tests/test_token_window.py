"""The token-by-token window of draft models and HSDDW: confidence rates, the tokens-per-millisecond stop, and its
place in the cost-aware wrapper (greedy identity here; sampling exactness in test_sampling_chained_drafts.py)."""

import numpy as np
import pytest

from hierspec.accept import Verdict
from hierspec import calibration
from hierspec.calibration import CostCurve, save_curve
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.base import Drafter
from hierspec.drafters.cost_aware import CostAwareDrafter
from hierspec.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from hierspec.drafters.token_window import ConfidenceRates, TokenWindow
from hierspec.methods import DrafterContext, make_drafter
from hierspec.tree import chain
from tiny import make_target

FLAT = CostCurve((1, 8, 64), (10.0, 10.0, 40.0), {}).cost  # 10 ms for up to 8 rows


def test_rates_start_at_each_buckets_confidence_and_learn_up_to_the_first_rejection():
    rates = ConfidenceRates(buckets=10, decay=0.5)
    assert rates.rate(0.95) == pytest.approx(0.95) and rates.rate(0.0) == pytest.approx(0.05)
    assert rates.rate(1.0) == pytest.approx(0.95)  # the top bucket holds confidence 1
    rates.record([0.95, 0.91, 0.12, 0.97], accepted=1)  # token 1 passed, token 2 rejected, tokens 3-4 unseen
    # bucket 9: 1 hit in 2 trials -> (1 + 2 * 0.95) / (2 + 2) = 0.725; bucket 1 untouched
    assert rates.rate(0.93) == pytest.approx(0.725) and rates.rate(0.12) == pytest.approx(0.15)
    rates.record([0.95], accepted=1)  # the counts halve first: 0.5 hit + 1 = 1.5 of 1 + 1 = 2 trials
    assert rates.rate(0.95) == pytest.approx((1.5 + 1.9) / (2 + 2))
    rates.keep(0.0)
    assert rates.rate(0.95) == pytest.approx(0.95)


def test_the_window_goes_on_while_one_more_token_raises_tokens_per_millisecond():
    cheap = TokenWindow(FLAT, lambda tokens: 1.0 * tokens)
    cheap.add(0.95)
    # now (1 + 0.95) / (1 + 10) = 0.177 tokens/ms; one more as sure: (1.95 + 0.95^2) / (2 + 10) = 0.238
    assert cheap.worth_more()
    cheap.add(0.05)
    # now (1.95 + 0.95 * 0.05) / 12 = 0.1665; more: (1.9975 + 0.0475 * 0.05) / 13 = 0.1538
    assert not cheap.worth_more() and cheap.stops == 1
    costly = TokenWindow(FLAT, lambda tokens: 10.0 * tokens)
    costly.add(0.95)
    # now 1.95 / 20 = 0.0975; more: 2.8525 / 30 = 0.0951
    assert not costly.worth_more()
    costly.start(rows=60, tokens=4.0)  # a batch: 60 other rows (verification 10 -> ~37 ms) and 4 tokens of theirs
    costly.add(0.95)
    # now 5.95 / (10 + c(62)) ; more: (5.95 + 0.9025) / (20 + c(63)): the shared forward makes one more token cheap
    assert costly.worth_more() == (6.8525 / (20 + FLAT(63)) > 5.95 / (10 + FLAT(62)))


def test_a_window_learns_only_the_tokens_that_were_verified():
    window = TokenWindow(FLAT, lambda tokens: 0.0)
    for confidence in (0.95, 0.95, 0.15):
        window.add(confidence)
    window.learn(drafted=2, accepted=2)  # the third token was cut before verification: no trial for bucket 1
    assert window.rates.rate(0.15) == pytest.approx(0.15)
    assert window.rates.rate(0.95) == pytest.approx((2 + 1.9) / 4)


class _Sure(Drafter):
    """Drafts tokens 1, 2, 3... with the given confidences, one at a time, asking the window after each."""

    name = "sure"

    def __init__(self, confidences):
        self.confidences = confidences
        self.window = None
        self.budgets = []

    def use_window(self, window):
        self.window = window
        return True

    def draft_cost(self, tokens):
        return 1.0 * tokens

    def propose(self, context, budget):
        self.budgets.append(budget)
        tokens = []
        for confidence in self.confidences[:budget]:
            tokens.append(len(tokens) + 1)
            self.window.add(confidence)
            if not self.window.worth_more():
                break
        return chain(int(context[-1]), tokens, ["sure"] * len(tokens))


def test_the_wrapper_hands_its_window_over_and_learns_from_the_verdicts():
    inner = _Sure([0.95, 0.95, 0.95, 0.05, 0.95])
    drafter = CostAwareDrafter(inner, FLAT)
    assert drafter.window is inner.window
    tree = drafter.propose(np.array([7]), 8)
    # tokens 1-3 sure; after the 0.05 token one more cannot pay (as in the test above): 4 tokens, asked for all 8
    assert tree.num_drafted == 4 and inner.budgets == [8] and drafter.report()["window_stops"] == 1
    drafter.observe(Verdict(tree, path=(1, 2, 3), bonus=0, target_argmax=np.zeros(tree.size, dtype=int)),
                    np.array([7]))
    assert drafter.window.rates.rate(0.95) == pytest.approx((3 + 1.9) / 5)
    assert drafter.window.rates.rate(0.05) == pytest.approx((0 + 0.1) / 3)
    drafter.begin(np.array([1]))
    assert drafter.window.rates.rate(0.05) == pytest.approx(0.1 / (0.25 + 2))  # a quarter carried over
    assert drafter.report()["window_stops"] == 0


def test_a_retrieval_drafter_gets_no_window():
    assert CostAwareDrafter(PromptLookupDrafter(PromptLookupConfig()), FLAT).window is None


def _curve(tmp_path):
    path = tmp_path / "curve.json"
    save_curve(CostCurve((1, 8, 64), (10.0, 10.5, 40.0), {}), path)
    return str(path)


def test_windowed_sd_and_hsddw_reproduce_plain_decoding(tmp_path, monkeypatch):
    # the draft's step cost fixed at a twentieth of the target's (its curve flat, its step timed against the
    # target's in pairs): measured, as it otherwise is, it came out dear enough under a loaded suite to keep every
    # window at one token
    monkeypatch.setattr(calibration, "verification_cost", lambda model, measure=True: lambda rows: 0.5)
    monkeypatch.setattr(calibration, "saved_paired_cost_ratio", lambda model, reference: 0.05)
    target = make_target("llama", vocab_size=64, seed=3)
    context = DrafterContext(target, cost_curve=_curve(tmp_path))
    rng = np.random.default_rng(9)
    config = GenerationConfig(max_new_tokens=40)
    sd = make_drafter("sd:draft=self:1,k=8", context)
    hsddw = make_drafter("hsddw:first=pld,middle=self:1,max_block=8", context)
    assert sd.window is sd.inner.window is not None and hsddw.inner.window is hsddw.window is not None
    lengths = set()
    for _ in range(3):
        motif = rng.integers(1, 64, size=5).tolist()
        prompt = motif * 3 + motif[:2]
        reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config).token_ids
        for drafter in (sd, hsddw):
            result = SpeculativeDecoder(target, drafter).generate(prompt, config)
            assert result.token_ids == reference
            lengths.update(drafter.inner.windows)
    assert len(lengths) > 1  # the windows varied: the rule was at work, not a fixed length
