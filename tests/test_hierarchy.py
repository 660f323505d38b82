"""Hierarchy Drafting: access order, stopping at N, recycling of the verifier's tokens, per-source accounting."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hierspec.accept import accept_greedy
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.hierarchy import (HierarchyConfig, HierarchyDrafter, frequent_rows,
                                         frequent_rows_with_shares)
from hierspec.errors import InputError
from hierspec.methods import make_drafter
from hierspec.tree import build_tree
from tiny import make_target


class StubDatabase:
    """Returns fixed sequences and records how often and with which limit it was read."""

    def __init__(self, sequences):
        self.sequences = sequences
        self.calls = []

    def retrieve(self, context, limit):
        self.calls.append(limit)
        return self.sequences[:limit]


def _drafter(order="cms", n=3, m=4, model=(), statistics=(), l=1):
    model_db, stats_db = StubDatabase([list(s) for s in model]), StubDatabase([list(s) for s in statistics])
    drafter = HierarchyDrafter(HierarchyConfig(l=l, m=m, n=n, order=order, lead="cms", tree="fixed"), model_db, stats_db)
    return drafter, model_db, stats_db


def test_databases_are_read_in_order_until_n_sequences():
    drafter, model_db, stats_db = _drafter(model=[[3], [4], [5]], statistics=[[6]])
    drafter.begin(np.array([9, 1, 2, 7, 7, 9]))  # the context DB learns 9 -> (1, 2, 7, 7)
    sequences, sources = drafter.collect(np.array([5, 9]))
    assert [s.tolist() for s in sequences] == [[1, 2, 7, 7], [3], [4]]
    assert sources == ["context", "model", "model"]
    assert model_db.calls == [2]  # asked only for what was missing
    assert stats_db.calls == []  # N reached: the statistics store is never read


def test_a_custom_order_and_duplicates():
    drafter, model_db, stats_db = _drafter(order="smc", n=4, model=[[6, 1], [8]], statistics=[[6, 1, 2], [7]])
    drafter.begin(np.array([9, 6, 1, 2, 3]))
    sequences, sources = drafter.collect(np.array([9]))
    # [6, 1] from the model store is a prefix of the statistics store's [6, 1, 2]: it adds no node and is skipped
    assert [s.tolist() for s in sequences] == [[6, 1, 2], [7], [8], [6, 1, 2, 3]]
    assert sources == ["statistics", "statistics", "model", "context"]
    assert stats_db.calls == [4] and model_db.calls == [2]


def test_missing_databases_are_skipped_and_context_alone_works():
    drafter = HierarchyDrafter(HierarchyConfig(l=1, m=3, n=2, order="cms", tree="fixed"))
    assert drafter.sources == ["context"]
    drafter.begin(np.array([4, 5, 6, 7]))
    tree = drafter.propose(np.array([4, 5, 6, 7, 4]), budget=10)
    assert tree.tokens.tolist() == [4, 5, 6, 7] and tree.sources[1:] == ("context",) * 3
    assert drafter.propose(np.array([4, 5, 6, 7, 4]), budget=0).size == 1


def test_tree_nodes_are_tagged_and_budget_respected():
    drafter, _, _ = _drafter(n=3, m=3, model=[[1, 2, 3], [1, 5]], statistics=[[8, 8, 8]])
    tree = drafter.propose(np.array([0]), budget=4)
    assert tree.num_drafted == 4
    assert dict(zip(tree.tokens.tolist()[1:], tree.sources[1:])) == {1: "model", 2: "model", 3: "model", 5: "model"}
    tree = drafter.propose(np.array([0]), budget=32)
    assert tree.sources.count("statistics") == 3 and tree.num_drafted == 7


def test_begin_resets_the_context_database_between_generations():
    drafter = HierarchyDrafter(HierarchyConfig(l=1, m=2, n=2, order="c"))
    drafter.begin(np.array([1, 2, 3]))
    assert drafter.collect(np.array([1]))[0][0].tolist() == [2, 3]
    drafter.begin(np.array([5, 6, 7]))
    assert drafter.collect(np.array([1]))[0] == []


def test_recycling_adds_the_targets_predictions_off_the_accepted_path():
    drafter = HierarchyDrafter(HierarchyConfig(l=2, m=3, n=4, order="c"))
    context = np.array([10, 11, 12])
    drafter.begin(context)
    drafter.propose(context, budget=8)
    # root 12; drafts [20, 21] and [30]. Target argmax per node (BFS: 12, 20, 30, 21): after 12 -> 20 (accept),
    # after 20 -> 40 (reject 21), after 30 -> 31, after 21 -> 22.
    tree = build_tree(12, [[20, 21], [30]])
    logits = torch.full((tree.size, 64), -1.0)
    predictions = {0: 20, 1: 40, 2: 31, 3: 22}
    for node, token in predictions.items():
        logits[node, token] = 1.0
    verdict = accept_greedy(tree, logits)
    assert verdict.path == (1,) and verdict.bonus == 40
    drafter.observe(verdict, np.array([10, 11, 12, 20, 40]))
    table = drafter.context_db.snapshot()
    assert table[(12, 30)] == [(31,)]  # the rejected branch [30] taught what follows 12 30
    assert table[(20, 21)] == [(22,)]  # and [20, 21], below the accepted node
    assert (12, 20) not in table  # on-path predictions are committed tokens, fed from the context instead


def test_recycled_chains_follow_the_tree_and_topk_adds_alternatives():
    drafter = HierarchyDrafter(HierarchyConfig(l=1, m=3, n=4, order="c", recycle_topk=2))
    assert drafter.verifier_topk == 2
    drafter.begin(np.array([1, 2]))
    drafter.propose(np.array([1, 2]), budget=8)
    tree = build_tree(2, [[5, 6, 7], [9]])  # BFS: 2, 5, 9, 6, 7
    logits = torch.zeros((tree.size, 16))
    best = {0: 3, 1: 6, 2: 9, 3: 7, 4: 8}  # root predicts 3: nothing accepted
    second = {0: 4, 1: 1, 2: 1, 3: 1, 4: 1}
    for node in range(tree.size):
        logits[node, best[node]] = 2.0
        logits[node, second[node]] = 1.0
    verdict = accept_greedy(tree, logits, topk=2)
    assert verdict.path == () and verdict.target_topk.shape == (5, 2)
    drafter.observe(verdict, np.array([1, 2, 3]))
    table = drafter.context_db.snapshot()
    assert table[(5,)] == [(6, 7, 8), (1,)]  # 5 -> 6 (a child) -> 7 (a child) -> 8: the chain follows the tree
    assert table[(9,)] == [(9,), (1,)]
    assert table[(2,)] == [(4,)]  # the root's argmax is committed; its runner-up is recycled


def test_frequent_rows_ranks_and_trims_padding():
    rows = np.array([[1, 2], [3, -1], [1, 2], [5, 5], [3, -1], [1, 2]])
    assert [r.tolist() for r in frequent_rows(rows, 5, 1)] == [[1, 2], [3], [5, 5]]
    assert [r.tolist() for r in frequent_rows(rows, 5, 2)] == [[1, 2], [3]]
    assert frequent_rows(rows, 0, 1) == []


def _frequent_rows_by_unique(rows, limit, min_count):
    """The ranking as np.unique over the rows gave it (count descending, then the rows in order)."""
    unique, counts = np.unique(rows, axis=0, return_counts=True)
    out = []
    for i in np.lexsort((np.arange(unique.shape[0]), -counts)):
        if counts[i] < min_count or len(out) == limit:
            break
        row = unique[i][: int(np.argmax(unique[i] < 0))] if (unique[i] < 0).any() else unique[i]
        if row.shape[0]:
            out.append((row.tolist(), float(counts[i]) / rows.shape[0]))
    return out


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(-1, 3), min_size=3, max_size=3), min_size=1, max_size=40),
       limit=st.integers(1, 8), min_count=st.integers(1, 3))
def test_frequent_rows_rank_as_np_unique_did(rows, limit, min_count):
    rows = np.array(rows, dtype=np.int64)
    found = frequent_rows_with_shares(rows, limit, min_count)
    assert [(row.tolist(), share) for row, share in found] == _frequent_rows_by_unique(rows, limit, min_count)
    assert all(row.dtype == np.int64 for row, _ in found)


@pytest.mark.parametrize("option", ["order=cx", "order=cc", "n=0", "s_min_share=2", "l=0", "a_len=0", "prior=0",
                                    "prior=1", "credit=all"])
def test_bad_options_are_refused(option):
    target = make_target("llama", vocab_size=32, seed=4)
    with pytest.raises(InputError, match="order|must|share|>=|between|best or"):
        make_drafter(f"hd:{option}", target)


def test_per_source_accounting_in_a_real_run():
    target = make_target("llama", vocab_size=32, seed=4)
    prompt = [3, 4, 5, 6, 3, 4, 5]
    config = GenerationConfig(max_new_tokens=30)
    reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config).token_ids
    # a model store that knows the right continuation of every token after its first use, and a wrong statistics one
    truth = prompt + reference

    class Oracle:
        def retrieve(self, context, limit):
            return [truth[len(context):len(context) + 3]] if len(context) < len(truth) else []

    drafter = HierarchyDrafter(HierarchyConfig(l=2, m=3, n=2, order="msc", lead="cms", tree="fixed"), Oracle(), StubDatabase([[31, 31]]))
    result = SpeculativeDecoder(target, drafter).generate(prompt, config)
    s = result.stats
    assert result.token_ids == reference
    assert s.accepted_by_source.get("model", 0) > 0 and s.accepted_by_source.get("statistics", 0) == 0
    assert sum(s.accepted_by_source.values()) == s.accepted_drafts
    assert sum(s.drafted_by_source.values()) == s.drafted_tokens
    assert s.won_by_source.get("model", 0) == sum(1 for n in s.accept_lengths if n > 1)
    assert s.drafted_by_source["statistics"] > 0


def test_non_leading_databases_only_extend_a_leading_draft():
    drafter = HierarchyDrafter(HierarchyConfig(l=1, m=3, n=3, order="cms", lead="c", tree="fixed"),
                               StubDatabase([[3, 3]]), StubDatabase([[4]]))
    drafter.begin(np.array([9, 1, 2, 5]))  # context DB: 9 -> (1, 2, 5)
    assert drafter.collect(np.array([7])) == ([], [])  # only model and statistics drafts: no draft at all
    assert drafter.propose(np.array([7]), budget=8).size == 1
    sequences, sources = drafter.collect(np.array([9]))
    assert [s.tolist() for s in sequences] == [[1, 2, 5], [3, 3], [4]]
    assert sources == ["context", "model", "statistics"]
    with pytest.raises(InputError):
        HierarchyConfig(lead="x")


def test_hd_finds_stores_in_the_default_location(tmp_path):
    from hierspec.datastore.format import default_store_dir
    from hierspec.datastore.model_store import ModelStoreConfig
    from hierspec.store_builds import build_model_store
    from hierspec.datastore.suffix import build_suffix_store
    from hierspec.methods import DrafterContext

    target = make_target("llama", vocab_size=32, seed=4)
    root = default_store_dir(target.tokenizer_fingerprint, tmp_path)
    assert make_drafter("hd", DrafterContext(target, store_root=str(tmp_path))).sources == [
        "automaton", "context", "successors"]
    build_model_store(target, ["w1 w2", "w3 w4"], root / "model", ModelStoreConfig(max_new_tokens=6, method="ar"))
    build_suffix_store(["w1 w2 w3 w4 w5"], target.tokenizer, "tiny", target.tokenizer_fingerprint, root / "suffix")
    found = make_drafter("hd", DrafterContext(target, store_root=str(tmp_path)))
    assert found.sources == ["automaton", "context", "model", "statistics", "successors"]
    assert found.describe()["stores"] == {"model": str(root / "model"), "statistics": str(root / "suffix")}
    assert make_drafter("hd:order=cs", DrafterContext(target, store_root=str(tmp_path))).sources == [
        "context", "statistics"]
    ignored = DrafterContext(target, store_root=str(tmp_path), find_default_stores=False)
    assert make_drafter("hd", ignored).sources == ["automaton", "context", "successors"]


def _rejecting_verdict(tree, wrong: int, vocab: int = 16):
    """A verdict in which the target predicts ``wrong`` after every node: no draft token is accepted."""
    logits = torch.zeros((tree.size, vocab))
    logits[:, wrong] = 1.0
    return accept_greedy(tree, logits)


def test_scored_tree_explores_when_nothing_pays_and_backs_off():
    """A cost curve on which no draft pays (2 rows cost 10x one), a context database that always offers a
    candidate, and a target that rejects everything: the tree is empty except every ``explore_every``-th step,
    when the best single node is drafted; each rejected exploration doubles the interval (8, 16, 32, 64); an
    accepted one brings it back to 8; ``explore_every=0`` never drafts."""
    def steep(rows: int) -> float:
        return 1.0 if rows == 1 else 10.0

    def drafted_steps(explore_every: int, accept_from: int | None = None, steps: int = 140) -> list[int]:
        drafter = HierarchyDrafter(HierarchyConfig(l=1, m=2, order="c", explore_every=explore_every), cost=steep)
        context = np.array([1, 2, 3, 1, 2, 3, 1, 2])  # after 2 the context database offers (3, 1)
        drafter.begin(context)
        drafted = []
        for step in range(1, steps + 1):
            tree = drafter.propose(context, budget=8)
            if tree.size > 1:
                drafted.append(step)
                assert tree.size == 2 and tree.tokens.tolist() == [2, 3]
            right = accept_from is not None and step >= accept_from
            drafter.observe(_rejecting_verdict(tree, 3 if right else 9), context)
        return drafted

    assert drafted_steps(8) == [8, 24, 56, 120]
    assert drafted_steps(8, accept_from=24) == [8, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136]
    assert drafted_steps(0) == []
    with pytest.raises(InputError):
        HierarchyConfig(explore_every=-1)


def test_learned_state_is_shared_by_one_methods_generations_only(tmp_path):
    """Drafters built from one context for the same method (the server's concurrent requests) share the successor
    table and the earlier outputs; another method (a benchmark's next column) learns on its own."""
    from hierspec.methods import DrafterContext

    target = make_target("llama", vocab_size=32, seed=4)
    context = DrafterContext(target, store_root=str(tmp_path))
    first, second = (make_drafter("hd:order=cto", context) for _ in range(2))
    other = make_drafter("hd:order=cto,l=1", context)
    assert first.successors is second.successors and first.outputs.recent is second.outputs.recent
    assert first.outputs is not second.outputs  # each generation keeps its own running match
    assert other.successors is not first.successors and other.outputs.recent is not first.outputs.recent
    result = SpeculativeDecoder(target, first).generate([3, 4, 5, 6], GenerationConfig(max_new_tokens=8))
    assert first.outputs.recent.outputs == 1 and other.outputs.recent.outputs == 0
    assert len(second.outputs.recent) == len(result.token_ids) + 1  # the output and its separator


def test_bench_warms_up_on_a_prompt_outside_the_questions():
    from hierspec.bench.questions import load_questions
    from hierspec.bench.runner import WARM_UP_PROMPT

    questions = load_questions(Path(__file__).parents[1] / "data" / "spec_bench_dev.jsonl")
    assert all(WARM_UP_PROMPT not in turn for question in questions for turn in question.turns)


def test_longest_match_sources_draft_a_len_tokens_and_the_others_m():
    """Where the text repeats itself, the automaton's continuation runs ``a_len`` deep while the context database's
    stops at ``m``; a fixed tree keeps every sequence at ``m``."""
    text = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], dtype=np.int64)
    drafter = HierarchyDrafter(HierarchyConfig(l=1, m=2, a_len=5, order="ac"))
    drafter.begin(text)
    found = {candidate.source: candidate.tokens for candidate in drafter.candidates(text)}
    assert found == {"automaton": (3, 4, 5, 6, 7), "context": (3, 4)}
    fixed = HierarchyDrafter(HierarchyConfig(l=1, m=2, a_len=5, n=1, order="ac", tree="fixed"))
    fixed.begin(text)
    assert [list(seq) for seq in fixed.collect(text)[0]] == [[3, 4]]
