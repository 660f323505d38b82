"""The context-dependent database: LRU per key, refresh on a repeated value, feeding from a growing context."""

import numpy as np
import pytest

from hierspec.drafters.context_db import ContextDB
from hierspec.errors import InputError


def test_lru_evicts_the_least_recently_used_value():
    db = ContextDB(key_len=1, value_len=2, capacity=3)
    for value in [(1, 1), (2, 2), (3, 3)]:
        db.add((9,), value)
    db.add((9,), (4, 4))
    assert db.snapshot()[(9,)] == [(2, 2), (3, 3), (4, 4)]  # (1, 1) was least recently used
    assert db.lookup(np.array([5, 9]), 10) == [(4, 4), (3, 3), (2, 2)]  # most recent first
    assert db.lookup(np.array([9]), 2) == [(4, 4), (3, 3)]


def test_a_hit_refreshes_and_protects_from_eviction():
    db = ContextDB(key_len=1, value_len=2, capacity=3)
    for value in [(1, 1), (2, 2), (3, 3)]:
        db.add((9,), value)
    db.add((9,), (1, 1))  # seen again: now the most recent
    db.add((9,), (4, 4))  # evicts (2, 2), the least recently used now
    assert db.snapshot()[(9,)] == [(3, 3), (1, 1), (4, 4)]
    db.add((9,), (3,))  # a prefix of a stored value refreshes that value
    assert db.snapshot()[(9,)] == [(1, 1), (4, 4), (3, 3)]


def test_a_longer_value_replaces_its_prefix_and_values_are_cut_to_m():
    db = ContextDB(key_len=2, value_len=3, capacity=2)
    db.add((1, 2), (5,))
    db.add((1, 2), (5, 6, 7, 8))
    assert db.snapshot() == {(1, 2): [(5, 6, 7)]}
    assert len(db) == 1


def test_keys_are_separate_and_short_contexts_find_nothing():
    db = ContextDB(key_len=2, value_len=2, capacity=2)
    db.add((1, 2), (3, 4))
    db.add((2, 2), (7, 7))
    assert db.lookup(np.array([0, 1, 2]), 4) == [(3, 4)]
    assert db.lookup(np.array([2, 2]), 4) == [(7, 7)]
    assert db.lookup(np.array([2]), 4) == []
    assert db.lookup(np.array([1, 3]), 4) == []


def test_feed_context_adds_each_complete_gram_once_in_order():
    context = np.array([1, 2, 3, 1, 2, 4, 1, 2])
    db = ContextDB(key_len=2, value_len=2, capacity=4)
    db.feed_context(context)
    # grams (1,2)->(3,1), (2,3)->(1,2), (3,1)->(2,4), (1,2)->(4,1), (2,4)->(1,2); the last key (1, 2) at the end
    # has no complete value yet
    assert db.snapshot() == {(1, 2): [(3, 1), (4, 1)], (2, 3): [(1, 2)], (3, 1): [(2, 4)], (2, 4): [(1, 2)]}
    assert db.lookup(context, 4) == [(4, 1), (3, 1)]


def test_incremental_feeding_equals_feeding_at_once():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5, size=60)
    whole = ContextDB(2, 3, 3)
    whole.feed_context(tokens)
    grown = ContextDB(2, 3, 3)
    end = 7
    grown.feed_context(tokens[:end])
    while end < tokens.shape[0]:
        end = min(tokens.shape[0], end + int(rng.integers(1, 5)))
        grown.feed_context(tokens[:end])
    assert grown.snapshot() == whole.snapshot()


def test_reset_forgets_everything():
    db = ContextDB(1, 2, 2)
    db.feed_context(np.array([1, 2, 3, 4, 5]))
    assert len(db) > 0
    db.reset()
    assert len(db) == 0 and db.lookup(np.array([1]), 3) == []
    db.feed_context(np.array([7, 8, 9]))  # feeding restarts at position 0
    assert db.snapshot() == {(7,): [(8, 9)]}


@pytest.mark.parametrize("args", [(0, 2, 2), (1, 0, 2), (1, 2, 0)])
def test_bad_shapes_are_refused(args):
    with pytest.raises(InputError):
        ContextDB(*args)
