"""HSDDW with two real tiny transformer drafters is lossless under sampling (χ², as ``test_sampling_lossless.py``).

A tiny Llama drafts with self-verify and its own KV cache, a tiny Qwen2 pre-verifies and extends with its own KV
cache, the target verifies the block: unlike the table-driven cases in ``test_sampling_draft_models.py``, the
distributions here come from real forwards after cache roll-backs, so a stale cache entry would bias the law. Its own
module so that pytest-xdist can run it beside the other χ² tests (10 000 runs, ``RUNS``).
"""

from hierspec.datastore.recent_outputs import RecentOutputs
from hierspec.datastore.successors import SuccessorTable
from hierspec.draft_lm import DraftLM
from hierspec.drafters.deferred_start import DeferredStart
from hierspec.drafters.draft_model import DraftModelConfig, DraftModelDrafter
from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter
from hierspec.drafters.hsddw import HSDDWConfig, HSDDWDrafter, pre_verified
from test_sampling_lossless import RUNS, SETTINGS, VOCAB, chi_square_pvalue, exact_joint, exact_table, sample_counts
from tiny import make_target


def test_hsddw_with_two_tiny_models_matches_exact_distribution():
    target = make_target("llama", vocab_size=VOCAB, seed=12, layers=1, hidden=16, init_std=0.2)
    first = make_target("llama", vocab_size=VOCAB, seed=21, layers=1, hidden=16, init_std=0.2)
    middle = make_target("qwen2", vocab_size=VOCAB, seed=33, layers=1, hidden=16, init_std=0.2)
    sampling = SETTINGS["temperature-0.7-top-p-0.9"]
    joint = exact_joint(exact_table(target, sampling))

    def drafter() -> HSDDWDrafter:
        fast = DraftModelDrafter(DraftLM(first), DraftModelConfig(k=2, self_verify=True, tau=1.5))
        return HSDDWDrafter(fast, DraftLM(middle), HSDDWConfig(tau=1.8, max_block=3))

    _assert_exact_law(target, drafter, sampling, joint)


def test_hd_pre_verified_by_a_draft_model_matches_exact_distribution():
    """``hd`` with a draft model (:func:`~hierspec.drafters.hsddw.pre_verified`, the cost-aware wrapper included):
    the databases' deterministic tree pre-verified by a tiny Qwen2, which continues it, then the target — after a
    first step whose tree goes to the target alone (the draft model's start deferred by one step)."""
    target, middle, sampling, joint, make_hd = _hd_setting()

    def drafter():  # a draft forward at a tenth of a target forward: drafting pays on this curve
        drafter = pre_verified(make_hd(), DraftLM(middle, step_cost=lambda rows: 1.0), lambda rows: 10.0 + 0.1 * rows)
        drafter.inner.start = _OneStepLate(drafter.inner.middle)
        return drafter

    _assert_exact_law(target, drafter, sampling, joint)


def test_hd_whose_draft_model_cannot_pay_sends_the_databases_trees_alone_and_matches_exact_distribution():
    """A draft forward priced at 9.8 ms against a 10 ms target step never pays, so every step is one the plan prices
    out and sends the databases' tree alone (:meth:`~hierspec.drafters.hsddw.HSDDWDrafter.free_proposal`):
    sampled through the wrapper, the law is the target's."""
    target, middle, sampling, joint, make_hd = _hd_setting()
    lms = []

    def drafter():
        lms.append(_Counted(middle, step_cost=lambda rows: 9.8))
        return pre_verified(make_hd(), lms[-1], lambda rows: 10.0)

    _assert_exact_law(target, drafter, sampling, joint)
    assert lms and sum(lm.scored for lm in lms) == 0  # the draft model never ran


def _hd_setting():
    """A tiny Llama target, a tiny Qwen2 draft model, the sampling setting and its exact joint law, and a maker of
    ``hd`` drafters (context, successors, automaton and earlier outputs; the outputs shared)."""
    target = make_target("llama", vocab_size=VOCAB, seed=12, layers=1, hidden=16, init_std=0.2)
    middle = make_target("qwen2", vocab_size=VOCAB, seed=33, layers=1, hidden=16, init_std=0.2)
    outputs = RecentOutputs(max_tokens=200)
    outputs.add([1, 2, 3, 1, 2, 5, 5, 0, 7])
    sampling = SETTINGS["temperature-0.7-top-p-0.9"]

    def make_hd() -> HierarchyDrafter:
        return HierarchyDrafter(HierarchyConfig(l=1, m=3, candidates=4, order="ctao", o_min_match=1),
                                successors=SuccessorTable(VOCAB, 4), outputs=outputs)

    return target, middle, sampling, exact_joint(exact_table(target, sampling)), make_hd


class _Counted(DraftLM):
    """Counts the forwards it scores, over every generation (``forwards`` restarts with each)."""

    scored = 0

    def score_tree_short(self, context, tree):
        self.scored += 1
        return super().score_tree_short(context, tree)


class _OneStepLate(DeferredStart):
    """Starts the draft model at the second step of every generation (the prompt here is one token: the real rule
    would start it at once), so that both kinds of step are sampled."""

    def ready(self, context, step_ms) -> bool:
        if not self.started and self.deferred_steps == 0:
            self.deferred_steps = 1
            return False
        self.started = True
        return True


def _assert_exact_law(target, drafter, sampling, joint) -> None:
    """χ² of the first three tokens over :data:`RUNS` seeded generations against the exact joint law."""
    counts, forwards_per_run = sample_counts(target, drafter, sampling, RUNS)
    assert counts.sum() == RUNS
    assert counts[joint == 0].sum() == 0, "a token outside the warped support was emitted"
    assert forwards_per_run < 3.0, "no block token was ever accepted: acceptance would go untested"
    pvalue = chi_square_pvalue(counts, joint, RUNS)
    assert pvalue > 1e-3, f"p = {pvalue:.2e}"
