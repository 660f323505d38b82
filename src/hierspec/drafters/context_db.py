"""The context-dependent database of Hierarchy Drafting (``D_c``): n-grams of the current generation, LRU per key.

Key = ``l`` tokens, value = the up to ``m`` tokens that followed them. Each key keeps at most ``capacity`` values;
adding a value the key already holds (or a prefix of one) refreshes it, and a full key evicts its least recently
used value. Values of different lengths coexist: a value that extends a stored one replaces it.

It is fed from three places (see :class:`~hierspec.drafters.hierarchy.HierarchyDrafter`): the prompt, every
committed token, and the target's own predictions at the nodes of each verified tree.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from hierspec.errors import InputError

Key = tuple[int, ...]
Value = tuple[int, ...]


class ContextDB:
    """An LRU n-gram table: ``key (l tokens) -> up to capacity values (<= m tokens)``, most recent last."""

    def __init__(self, key_len: int, value_len: int, capacity: int) -> None:
        if key_len < 1 or value_len < 1 or capacity < 1:
            raise InputError("the context database needs l >= 1, m >= 1 and N >= 1")
        self.key_len = key_len
        self.value_len = value_len
        self.capacity = capacity
        self._table: dict[Key, OrderedDict[Value, None]] = {}
        self._next_start = 0  # start position of the next context gram to add

    def reset(self) -> None:
        """Forget everything (a new generation starts)."""
        self._table.clear()
        self._next_start = 0

    def __len__(self) -> int:
        return sum(len(values) for values in self._table.values())

    def add(self, key: Key, value: Value) -> None:
        """Insert ``value`` under ``key`` as the most recently used one.

        A value equal to or a prefix of a stored one refreshes the stored one; a value extending a stored one
        replaces it. When the key holds more than ``capacity`` values the least recently used is evicted.
        """
        value = value[: self.value_len]
        if not value:
            return
        values = self._table.get(key)
        if values is None:
            self._table[key] = OrderedDict({value: None})
            return
        for stored in values:
            if stored[: len(value)] == value:
                values.move_to_end(stored)
                return
            if value[: len(stored)] == stored:
                del values[stored]
                break
        values[value] = None
        if len(values) > self.capacity:
            values.popitem(last=False)

    def lookup(self, context: np.ndarray, limit: int) -> list[Value]:
        """Up to ``limit`` values stored under the last ``l`` tokens of ``context``, most recently used first."""
        if context.shape[0] < self.key_len or limit <= 0:
            return []
        values = self._table.get(tuple(context[-self.key_len :].tolist()))
        if not values:
            return []
        return list(reversed(values))[:limit]

    def retrieve(self, context: np.ndarray, limit: int) -> list[Value]:
        """:meth:`lookup` under the name hierarchical access uses for every database."""
        return self.lookup(context, limit)

    def feed_context(self, context: np.ndarray) -> None:
        """Add every ``(l + m)``-gram of ``context`` not added yet (only grams whose value is complete).

        Called with the prompt and then with the growing context after each step; each gram is added once, in
        order, so the newest occurrence of a key's value is its most recent.
        """
        l, m = self.key_len, self.value_len
        last_start = context.shape[0] - l - m  # start of the last gram whose value is complete
        if last_start < self._next_start:
            return
        tokens = context[self._next_start : last_start + l + m].tolist()
        for i in range(last_start - self._next_start + 1):
            self.add(tuple(tokens[i : i + l]), tuple(tokens[i + l : i + l + m]))
        self._next_start = last_start + 1

    def snapshot(self) -> dict[Key, list[Value]]:
        """The table as plain lists (least recently used first), for inspection and tests."""
        return {key: list(values) for key, values in self._table.items()}
