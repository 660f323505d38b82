import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hierspec.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter, find_continuations


def _cont(context, **kwargs):
    kwargs.setdefault("min_ngram", 1)
    return [c.tolist() for c in find_continuations(np.array(context, dtype=np.int64), PromptLookupConfig(**kwargs))]


def test_docstring_example():
    assert _cont([5, 6, 7, 9, 5, 6, 8, 1, 5, 6], max_ngram=2, draft_len=3) == [[8, 1, 5], [7, 9, 5]]


def test_longest_ngram_wins():
    # suffix [1, 2, 3] occurs once (-> 9); [2, 3] also occurs before 4 but the 3-gram match stops the search
    assert _cont([2, 3, 4, 1, 2, 3, 9, 1, 2, 3], max_ngram=3, draft_len=2) == [[9, 1]]


def test_falls_back_to_shorter_ngrams_and_respects_min_ngram():
    assert _cont([4, 7, 1, 2, 7], max_ngram=3, min_ngram=1, draft_len=2) == [[1, 2]]
    assert _cont([4, 7, 1, 2, 7], max_ngram=3, min_ngram=2, draft_len=2) == []


def test_duplicate_and_prefix_continuations_are_dropped():
    assert _cont([1, 5, 1, 5, 1, 5, 1], max_ngram=1, draft_len=2, max_matches=4) == [[5, 1]]


def test_match_at_the_end_gives_a_short_continuation():
    assert _cont([3, 8, 3], max_ngram=1, draft_len=5) == [[8, 3]]


def test_default_skips_unigram_matches():
    drafter = PromptLookupDrafter()
    assert drafter.config.min_ngram == 2
    assert drafter.propose(np.array([4, 7, 1, 2, 7], dtype=np.int64), budget=8).num_drafted == 0
    assert drafter.propose(np.array([4, 7, 1, 2, 4, 7], dtype=np.int64), budget=8).tokens.tolist() == [7, 1, 2, 4, 7]


def test_no_match_gives_empty_tree():
    drafter = PromptLookupDrafter()
    tree = drafter.propose(np.array([1, 2, 3, 4], dtype=np.int64), budget=8)
    assert tree.num_drafted == 0 and tree.tokens.tolist() == [4]


def test_drafter_merges_matches_into_tree_within_budget():
    drafter = PromptLookupDrafter(PromptLookupConfig(max_ngram=1, min_ngram=1, draft_len=3, max_matches=2))
    tree = drafter.propose(np.array([7, 1, 2, 3, 7, 4, 5, 6, 7], dtype=np.int64), budget=4)
    # most recent match first: [4, 5, 6] whole, then [1] of [1, 2, 3]
    assert tree.tokens.tolist() == [7, 4, 1, 5, 6]
    assert set(tree.sources[1:]) == {"pld"}


def _brute_force(context, config):
    n_found = None
    for n in range(min(config.max_ngram, len(context) - 1), config.min_ngram - 1, -1):
        starts = [i for i in range(len(context) - n) if context[i:i + n] == context[-n:]]
        if starts:
            n_found = (n, starts)
            break
    if n_found is None:
        return []
    n, starts = n_found
    found = []
    for start in reversed(starts):
        cont = context[start + n:start + n + config.draft_len]
        if not any(kept[:len(cont)] == cont for kept in found):
            found.append(cont)
            if len(found) == config.max_matches:
                break
    return found


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    max_ngram=st.integers(1, 4),
    draft_len=st.integers(1, 6),
    max_matches=st.integers(1, 4),
)
def test_agrees_with_brute_force(context, max_ngram, draft_len, max_matches):
    config = PromptLookupConfig(max_ngram=max_ngram, min_ngram=1, draft_len=draft_len, max_matches=max_matches)
    assert _cont(context, max_ngram=max_ngram, draft_len=draft_len, max_matches=max_matches) == _brute_force(
        context, config)
