"""Speculative sampling with draft models is lossless: sd, sd + self-verify in the cost-aware token window, HSDDW and
retrieval → model → target (windowed).

Same method as ``test_sampling_lossless.py`` (exact joint law of the first three tokens, χ²), with 10 000 seeded runs (``RUNS``).
``sd`` uses a real tiny draft model, with its whole head and with a shortlist head (HSDDW with two real tiny models: ``test_sampling_hsddw_models.py``); the other
cases use :class:`TableLM` draft distributions, which exercise the same acceptance code at a fraction of the run time
(losslessness may not depend on what ``q`` is).
"""

import pytest

from drafters_for_tests import TableLM
from hierspec.calibration import CostCurve
from hierspec.draft_lm import DraftLM
from hierspec.drafters import PromptLookupConfig, PromptLookupDrafter
from hierspec.drafters.cost_aware import CostAwareDrafter
from hierspec.drafters.draft_model import DraftModelConfig, DraftModelDrafter
from hierspec.drafters.hsddw import HSDDWConfig, HSDDWDrafter
from test_sampling_lossless import RUNS, SETTINGS, VOCAB, chi_square_pvalue, exact_joint, exact_table, sample_counts
from tiny import make_target


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, seed=12, layers=1, hidden=16, init_std=0.2)


@pytest.fixture(scope="module")
def weak():
    return make_target("llama", vocab_size=VOCAB, seed=21, layers=1, hidden=16, init_std=0.2)


def _sd(lm, self_verify, k=3):
    return DraftModelDrafter(lm, DraftModelConfig(k=k, self_verify=self_verify, tau=1.5))


#: 10 ms to verify up to 8 rows; with 1 ms per drafted token the cost-aware window drafts past a token only when its
#: confidence's prior rate is above ~0.35 (11 p^2 - p - 1 > 0 for the first token), so the window's length depends
#: on the tokens drawn: the stopping rule whose exactness the windowed cases test
WINDOW_COST = CostCurve((1, 8, 64), (10.0, 10.0, 40.0), {}).cost

#: a draft head over every other token (FR-Spec's shortlist): the draft's q is zero on the rest, which the
#: target's own tokens often are
SHORTLIST = list(range(0, VOCAB, 2))

CASES = {
    "sd": lambda weak: _sd(DraftLM(weak), False, k=2),
    "sd+shortlist": lambda weak: _sd(DraftLM(weak, head=weak.head_over(SHORTLIST)), False, k=2),
    # the cost-aware wrapper's token window on top of self-verify (the default wrapping of sd and hsddw)
    "sd+self-verify+window": lambda weak: CostAwareDrafter(_sd(TableLM(VOCAB, seed=1, step_ms=1.0), True),
                                                           WINDOW_COST),
    "hsddw": lambda weak: HSDDWDrafter(_sd(TableLM(VOCAB, seed=1), True), TableLM(VOCAB, seed=2, scale=1.0),
                                       HSDDWConfig(tau=1.8, max_block=4)),
    "pld>model>target+window": lambda weak: CostAwareDrafter(HSDDWDrafter(
        PromptLookupDrafter(PromptLookupConfig(max_ngram=1, min_ngram=1)),
        TableLM(VOCAB, seed=2, scale=1.0, step_ms=1.0), HSDDWConfig(tau=1.8, max_block=4)), WINDOW_COST),
}
#: the cases this file runs; the chained ones run in ``test_sampling_chained_drafts.py``
OWN_CASES = ("sd", "sd+shortlist", "sd+self-verify+window")


@pytest.mark.parametrize("case", OWN_CASES)
def test_draft_model_sampling_matches_exact_distribution(target, weak, case):
    check_case(target, weak, case)


def check_case(target, weak, case: str) -> None:
    """χ² of the first three tokens sampled with drafter ``case`` against their exact joint law; a windowed case
    must also have seen its window both stop a draft and let one run to its cap."""
    sampling = SETTINGS["temperature-0.7-top-p-0.9"]
    joint = exact_joint(exact_table(target, sampling))
    made = []

    def drafter():
        made.append(CASES[case](weak))
        return made[-1]

    counts, forwards_per_run = sample_counts(target, drafter, sampling, RUNS)
    assert counts[joint == 0].sum() == 0, "a token outside the warped support was emitted"
    assert forwards_per_run < 3.0, "no draft was ever accepted: acceptance would go untested"
    if case.endswith("+window"):
        stops = [d.window.stops for d in made]
        assert 0 < sum(s > 0 for s in stops) < len(made), "the window never decided anything"
    pvalue = chi_square_pvalue(counts, joint, RUNS)
    assert pvalue > 1e-3, f"{case}: p = {pvalue:.2e}"
