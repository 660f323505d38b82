"""``h``: Hierarchy Drafting's source that reads the target's hidden state through a trained draft head.

The verification forward leaves the target's hidden state at the last accepted node, where it predicted the next
step's root. The head (:class:`~hierspec.datastore.draft_head.HeadStore`) turns that state and the root's embedding
into the target's likely next tokens; each guess is continued by the successor table's chain of first successors
when ``hd`` keeps one. A guess's confidence bin is its probability's bin, so the scored tree learns how often each
bin is right on this text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hierspec.datastore.draft_head import HeadStore, probability_bin
from hierspec.datastore.successors import SuccessorTable


@dataclass
class HeadDatabase:
    """Draft sequences from a draft head's guesses after the root.

    Attributes:
        store: the trained head.
        embeddings: the target's input embedding matrix ``[vocab, hidden]`` (the root's row is the head's input).
        depth: most tokens per sequence.
        width: guesses drafted per step (the head's top ``width``).
        successors: continues each guess with its chain of first successors (``None``: one-token guesses).
    """

    store: HeadStore
    embeddings: torch.Tensor
    depth: int
    width: int = 3
    successors: SuccessorTable | None = None
    _query: np.ndarray | None = field(default=None, init=False)

    @property
    def directory(self):
        return self.store.directory

    def reset(self) -> None:
        """Forget the hidden state (a new generation starts)."""
        self._query = None

    def set_query(self, hidden: np.ndarray) -> None:
        """The target's last hidden state where it predicted the next root."""
        self._query = hidden

    def retrieve_scored(self, context: np.ndarray, limit: int) -> list[tuple[tuple[int, ...], int]]:
        if self._query is None:
            return []
        tokens, probabilities = self.store.guess(self._query, self.embeddings[int(context[-1])],
                                                 min(self.width, limit))
        out = []
        for token, probability in zip(tokens.tolist(), probabilities.tolist()):
            sequence = (int(token),)
            if self.successors is not None and self.depth > 1:
                chains = self.successors.chains(int(token), self.depth - 1, 1)
                if chains:
                    sequence += tuple(chains[0][0])
            out.append((sequence, probability_bin(probability)))
        return out

    def retrieve(self, context: np.ndarray, limit: int) -> list[tuple[int, ...]]:
        return [tokens for tokens, _ in self.retrieve_scored(context, limit)]
