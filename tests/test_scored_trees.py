"""Scored draft trees: node probabilities from learned acceptance rates, best-first selection sized by the cost
curve, learning from verdicts; hand-made examples with the expected values written out."""

import numpy as np
import pytest

from hierspec.accept import Verdict
from hierspec.drafters.scored import AcceptanceModel, Candidate, select_tree


def _model_with_rates(rates: dict) -> AcceptanceModel:
    """An acceptance model whose (source, confidence, depth) cells have exactly the given rates."""
    model = AcceptanceModel(["a", "b"])
    for (source, confidence, depth), (hits, trials) in rates.items():
        cell = model.cell(source, confidence, depth)
        model.hits[cell], model.trials[cell] = hits, trials
    return model


# depth 1: rate = (hits + 2) / (trials + 4): 14/16 -> 0.8, 1/6 -> 0.3; deeper, the prior is 4 trials at the rate of
# the depth above: 3.8/6 at depth 2 under 0.8 -> (3.8 + 4 * 0.8) / (6 + 4) = 0.7
RATES = {("a", 0, 1): (14, 16), ("a", 0, 2): (3.8, 6), ("b", 0, 1): (1, 6)}


def _bucketed(rows: int) -> float:
    return 10.0 if rows <= 4 else 20.0


def test_the_docstring_example_keeps_every_node_a_free_bucket_holds():
    model = _model_with_rates(RATES)
    scored = select_tree(9, [Candidate((5, 6), "a"), Candidate((7,), "b")], model, _bucketed, budget=8)
    assert scored.tree.tokens.tolist() == [9, 5, 7, 6]
    assert scored.tree.sources == ("root", "a", "b", "a")
    np.testing.assert_allclose(scored.path_probability, [1.0, 0.8, 0.3, 0.56])
    assert scored.expected_tokens == pytest.approx(2.66)


def test_a_steep_cost_keeps_only_the_nodes_that_pay():
    model = _model_with_rates(RATES)
    candidates = [Candidate((5, 6), "a"), Candidate((7,), "b")]

    def steep(rows: int) -> float:  # each row costs half a step
        return 1.0 + 0.5 * (rows - 1)

    scored = select_tree(9, candidates, model, steep, budget=8)
    # 1 node: 1.8 / 1.5 = 1.2; 2 nodes: 2.36 / 2.0 = 1.18; none: 1.0 -> only the 0.8 node
    assert scored.tree.tokens.tolist() == [9, 5]

    def ruinous(rows: int) -> float:
        return float(rows) ** 2

    assert select_tree(9, candidates, model, ruinous, budget=8).tree.size == 1  # no draft pays
    assert select_tree(9, candidates, model, _bucketed, budget=1).tree.tokens.tolist() == [9, 5]


def test_a_node_reached_by_two_candidates_keeps_its_best_estimate():
    model = _model_with_rates(RATES)
    scored = select_tree(9, [Candidate((7,), "b"), Candidate((7,), "a")], model, _bucketed, budget=4)
    assert scored.tree.tokens.tolist() == [9, 7]
    assert scored.tree.sources[1] == "a" and scored.path_probability[1] == pytest.approx(0.8)


def test_learning_counts_a_node_only_when_its_parent_was_accepted():
    model = AcceptanceModel(["a"], decay=1.0)
    scored = select_tree(9, [Candidate((5, 6, 7), "a"), Candidate((8,), "a", confidence=2)], model, lambda rows: 1.0,
                         budget=8)
    tree = scored.tree  # BFS: 9 | 5 8 | 6 | 7
    assert tree.tokens.tolist() == [9, 5, 8, 6, 7]
    model.learn(scored, Verdict(tree=tree, path=(1,), bonus=3, target_argmax=np.zeros(5, dtype=np.int64)))
    def counts(confidence, depth):
        cell = model.cell("a", confidence, depth)
        return model.trials[cell], model.hits[cell]

    assert counts(0, 1) == (1, 1)  # node 5: tried, accepted
    assert counts(2, 1) == (1, 0)  # node 8: tried, rejected
    assert counts(0, 2) == (1, 0)  # node 6: its parent 5 was accepted
    assert counts(0, 3) == (0, 0)  # node 7: its parent 6 was rejected, so it was never really tried
    assert model.rate("a", 0, 1) == pytest.approx(3 / 5)  # (1 hit + 2) / (1 trial + 4)
    assert model.rate("a", 0, 2) == pytest.approx((0 + 4 * 3 / 5) / (1 + 4))  # rejected once, prior at 3/5
    assert model.rate("a", 0, 3) == pytest.approx((0 + 4 * 0.48) / (0 + 4))  # never tried: as the depth above
    counts = model.calibration_counts()
    assert sum(counts["nodes"]) == 4 and sum(counts["accepted"]) == 1


def _learned_counts(credit: str) -> dict:
    """Trials and hits per cell after one verdict on a tree whose first node two databases proposed."""
    model = AcceptanceModel(["a", "b"], decay=1.0, credit=credit)
    candidates = [Candidate((5, 6), "a"), Candidate((5,), "b", confidence=1), Candidate((7,), "b")]
    scored = select_tree(9, candidates, model, lambda rows: 1.0, budget=8)
    tree = scored.tree  # BFS: 9 | 5 7 | 6; node 5 proposed by a (bin 0) and by b (bin 1)
    assert tree.tokens.tolist() == [9, 5, 7, 6]
    assert scored.proposers[1] == (model.cell("a", 0, 1), model.cell("b", 1, 1))
    model.learn(scored, Verdict(tree=tree, path=(1,), bonus=3, target_argmax=np.zeros(4, dtype=np.int64)))
    cells = {("a", 0, 1), ("b", 1, 1), ("b", 0, 1), ("a", 0, 2)}
    return {key: (model.trials[model.cell(*key)], model.hits[model.cell(*key)]) for key in cells}


def test_shared_credit_splits_a_nodes_verdict_among_the_databases_that_proposed_it():
    counts = _learned_counts("shared")
    assert counts[("a", 0, 1)] == (0.5, 0.5)  # node 5, accepted: half a trial and half a hit each
    assert counts[("b", 1, 1)] == (0.5, 0.5)
    assert counts[("b", 0, 1)] == (1.0, 0.0)  # node 7, b's alone, rejected
    assert counts[("a", 0, 2)] == (1.0, 0.0)  # node 6, a's alone, rejected


def test_best_credit_gives_a_shared_nodes_verdict_to_its_best_estimate_only():
    counts = _learned_counts("best")
    assert counts[("a", 0, 1)] == (1.0, 1.0)  # both at the prior: the first proposer keeps the node
    assert counts[("b", 1, 1)] == (0.0, 0.0)
    assert counts[("b", 0, 1)] == (1.0, 0.0)
    assert counts[("a", 0, 2)] == (1.0, 0.0)


def test_no_candidates_or_no_budget_drafts_nothing():
    model = AcceptanceModel(["a"])
    assert select_tree(9, [], model, _bucketed, budget=8).tree.size == 1
    assert select_tree(9, [Candidate((1, 2), "a")], model, _bucketed, budget=0).tree.size == 1


def test_a_row_of_rates_read_alone_equals_the_whole_tables_row():
    rng = np.random.default_rng(3)
    model = AcceptanceModel(["a", "b", "c"])
    model.trials[:] = rng.uniform(0, 50, model.trials.shape)
    model.hits[:] = model.trials * rng.uniform(0, 1, model.trials.shape)
    table = model.rates()
    for source in range(3):
        for confidence in range(table.shape[1]):
            assert model.rates_of(source, confidence) == table[source, confidence].tolist()


def test_siblings_come_in_the_order_their_candidates_reached_them_and_deeper_nodes_after_their_level():
    model = AcceptanceModel(["a"])
    scored = select_tree(9, [Candidate((5, 6), "a"), Candidate((7, 8, 4), "a"), Candidate((5, 3), "a")], model,
                         lambda rows: 1.0, budget=8)
    tree = scored.tree  # trie ids: 5=1 6=2 7=3 8=4 4=5 3=6; breadth-first, siblings by id: 9 | 5 7 | 6 3 8 | 4
    assert tree.tokens.tolist() == [9, 5, 7, 6, 3, 8, 4]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 5]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert [tree.sequence(i) for i in range(1, 7)] == [[5], [7], [5, 6], [5, 3], [7, 8], [7, 8, 4]]


def test_an_untried_cell_starts_at_the_prior_and_each_deeper_depth_at_the_rate_above():
    assert AcceptanceModel(["a"]).rate("a", 0, 1) == 0.5  # the default: 1 in 2
    model = AcceptanceModel(["a"], prior=0.25)
    assert [model.rate("a", 0, depth) for depth in (1, 2, 7)] == [0.25, 0.25, 0.25]
    model.hits[model.cell("a", 0, 1)], model.trials[model.cell("a", 0, 1)] = 4, 4
    assert model.rate("a", 0, 1) == pytest.approx((4 + 4 * 0.25) / (4 + 4))  # 0.625
    assert model.rate("a", 0, 2) == pytest.approx(0.625)
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="between 0 and 1"):
            AcceptanceModel(["a"], prior=bad)


def test_on_a_steep_curve_an_untried_source_is_drafted_at_a_one_in_two_prior_and_not_at_one_in_four():
    def steep(rows: int) -> float:  # each row costs 0.4 step: one node pays when p > 0.4
        return 1.0 + 0.4 * (rows - 1)

    candidates = [Candidate((5,), "a")]
    assert select_tree(9, candidates, AcceptanceModel(["a"]), steep, budget=8).tree.tokens.tolist() == [9, 5]
    assert select_tree(9, candidates, AcceptanceModel(["a"], prior=0.25), steep, budget=8).tree.size == 1
