"""Draft language models: a second causal LM (or the target's own first layers) run incrementally with a KV cache.

:class:`DraftLM` keeps the cache in step with whatever context it is asked about: it remembers the tokens whose
keys and values the cache holds, crops the cache back to the longest common prefix with the new context (the
accepted prefix after a verification) and feeds only the missing tokens.

:func:`self_drafting_model` builds the draft model every target has: its first ``k`` decoder layers followed by its
final norm and LM head, sharing the target's weights (no copy, no training).
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from hierspec.errors import InputError
from hierspec.runtime import VocabHead
from hierspec.target import TargetModel
from hierspec.tree import DraftTree, below_chain, root_only

SELF_PREFIX = "self:"


def self_drafting_model(target: TargetModel, layers: int) -> TargetModel:
    """The target truncated to its first ``layers`` decoder layers, sharing every weight with the target.

    Works for decoders that keep their layers in an ``nn.ModuleList`` named ``layers`` and run
    ``config.num_hidden_layers`` of them (Llama, Qwen2, Mistral, Gemma, Phi-3 and most other Hugging Face causal
    LMs). The outer modules are shallow copies with their own child tables, so the target is left untouched.
    """
    model = target.model
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    stack = getattr(base, "layers", None)
    if base is None or not isinstance(stack, nn.ModuleList):
        raise InputError(f"{target.name}: self-drafting needs a decoder whose layers are an nn.ModuleList `layers`")
    total = len(stack)
    if not 1 <= layers < total:
        raise InputError(f"self-drafting takes 1 to {total - 1} of {target.name}'s {total} layers, not {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    short_base = _shallow_module_copy(base)
    short_base.layers = nn.ModuleList(list(stack)[:layers])
    short_base.config = config
    short = _shallow_module_copy(model)
    setattr(short, model.base_model_prefix, short_base)
    short.config = config
    return TargetModel(short, target.tokenizer, name=f"{target.name}[{SELF_PREFIX}{layers}]",
                       runtime=target.runtime.config)


def _shallow_module_copy(module: nn.Module) -> nn.Module:
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # its own child table: replacing a child leaves the original intact
    return clone


def check_same_tokenizer(draft: TargetModel, target: TargetModel) -> None:
    """Refuse a draft model whose tokenizer differs from the target's: its token ids would mean other text."""
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise InputError(
            f"the draft model {draft.name} uses another tokenizer than the target {target.name} "
            f"(fingerprints {draft.tokenizer_fingerprint[:12]} and {target.tokenizer_fingerprint[:12]}); "
            "use a model of the same family, or self-drafting (--draft-model self:K)"
        )
    if draft.vocab_size < target.vocab_size:
        raise InputError(f"the draft model {draft.name} has {draft.vocab_size} output rows, fewer than the "
                         f"target's {target.vocab_size}")


#: tokens the draft's cache lacks that are read in the same forward as the tree to score; more go through prefill
CATCH_UP_ROWS = 16
#: a prompt's reading is priced per token at the cost curve's forward of this many rows (its largest measured one:
#: Qwen2.5-Coder-0.5B on an Intel Xeon, 1.48 ms a token there against 1.44-1.84 ms measured over 150-950 tokens)
PREFILL_ROWS = 64


class DraftLM:
    """A model run incrementally over a growing, sometimes rolled back, context.

    With ``head`` (:meth:`~hierspec.target.TargetModel.head_over`, a shortlist of frequent tokens) every forward
    computes those tokens' logits only: the draft can only propose them, which changes what is accepted, never what
    is generated (the target verifies every token; a sampled draft's distribution is zero elsewhere, which
    speculative sampling allows). FR-Spec's observation: a large vocabulary's head is a large share of a small draft
    model's step (Qwen2.5-Coder-0.5B: 151,936 rows, ~25 % of its forward on a CPU), and a few tens of thousands of
    frequent tokens cover nearly every generated one.
    """

    def __init__(self, model: TargetModel, vocab_size: int | None = None,
                 step_cost: Callable[[int], float] | None = None, head: VocabHead | None = None) -> None:
        """``step_cost``: milliseconds of one of this model's forwards over ``rows`` tokens as this draft runs them
        (with ``head``), which cost-aware drafting weighs against the target's; ``None``: unknown, taken as free."""
        self.model = model
        self.vocab_size = vocab_size or model.vocab_size
        self._step_cost = step_cost
        self.head = head
        #: the token id of each score :meth:`next_scores` returns (``None``: the index is the id)
        self.tokens = None if head is None else head.tokens.cpu()
        if self.tokens is not None and int(self.tokens.max()) >= self.vocab_size:
            raise InputError(f"a draft's shortlist holds ids beyond the target's {self.vocab_size} tokens")
        self.reset()

    @functools.cached_property
    def step_ms(self) -> float:
        """Milliseconds of one one-token forward (read from the cost curve once, when first asked; 0 when unknown)."""
        return float(self._step_cost(1)) if self._step_cost is not None else 0.0

    @functools.cached_property
    def _prefill_token_ms(self) -> float:
        return float(self._step_cost(PREFILL_ROWS)) / PREFILL_ROWS if self._step_cost is not None else 0.0

    def prefill_ms(self, tokens: int) -> float:
        """Estimated milliseconds of reading ``tokens`` tokens the cache lacks through the prefill (0 when the cost
        curve is unknown; the curve is read once, when first asked)."""
        return max(0, tokens) * self._prefill_token_ms

    def lacks(self, context: np.ndarray) -> int:
        """How many tokens before ``context``'s last one the cache lacks (what the next draft would read first);
        the cache is left as it is."""
        return context.shape[0] - 1 - self._common(context[:-1])

    def reset(self) -> None:
        """Forget everything (start of a generation)."""
        self.forwards = 0
        self.reset_cache()

    def reset_cache(self) -> None:
        """Empty the cache."""
        self._cache = self.model.new_cache()
        self._tokens: list[int] = []  # tokens whose keys/values the cache holds, in order

    def _common(self, prefix: np.ndarray) -> int:
        """The length of the cache's longest common prefix with ``prefix``."""
        held = np.asarray(self._tokens[: prefix.shape[0]], dtype=np.int64)
        differs = np.flatnonzero(held != prefix[: held.shape[0]])
        return int(differs[0]) if differs.size else held.shape[0]

    def _missing(self, prefix: np.ndarray) -> list[int]:
        """Crop the cache to its longest common prefix with ``prefix``; return the rest of ``prefix``."""
        common = self._common(prefix)
        if common == 0 and self._tokens:
            self.reset_cache()
        elif common < len(self._tokens):
            self._cache.crop(common - len(self._tokens))
            del self._tokens[common:]
        return prefix[common:].tolist()

    def score_tree(self, context: np.ndarray, tree: DraftTree) -> torch.Tensor:
        """Logits after every node of ``tree`` (rooted at ``context[-1]``), ``[n, vocab]``, on the CPU (``-inf``
        for tokens outside a shortlist head); follow with :meth:`keep`.

        The tokens before the root that the cache lacks (after a verification, the target's own token) are read in
        the same forward, as a chain above the root — up to :data:`CATCH_UP_ROWS` of them; more (a prompt) go
        through the model's prefill first. A separate catch-up forward cost as much as a drafted token (Qwen2.5-
        Coder-0.5B on an Intel Xeon: ~80 ms through the prompt path against ~45 ms a forward).
        On the CPU because draft distributions meet the target's there (acceptance runs on the CPU, with a CPU
        random generator), wherever the draft model runs.
        """
        return self.spread(self.score_tree_short(context, tree), -torch.inf)

    def score_tree_short(self, context: np.ndarray, tree: DraftTree) -> torch.Tensor:
        """:meth:`score_tree`'s logits of the shortlist's tokens only, ``[n, len(tokens)]`` (all of them without a
        shortlist head)."""
        missing = self._missing(context[:-1])
        if len(missing) > CATCH_UP_ROWS:
            self.model.prefill(self._cache, missing)
            self.forwards += 1
            self._tokens.extend(missing)
            missing = []
        whole = below_chain(missing, tree)
        logits = self.model.forward_tree(self._cache, whole, head=self.head).logits
        self.forwards += 1
        self._pending = (whole, len(self._tokens), len(missing))
        logits = logits[len(missing):]
        return (logits if self.head is not None else logits[:, : self.vocab_size]).cpu()

    def token_ids(self, indices: np.ndarray) -> np.ndarray:
        """The token ids of score indices (into :meth:`score_tree_short`'s rows; the same ids without a
        shortlist)."""
        return indices if self.tokens is None else self.tokens.numpy()[indices]

    def spread(self, scores: torch.Tensor, fill: float) -> torch.Tensor:
        """Shortlist scores (``[..., len(tokens)]``) as ``[..., vocab]`` with ``fill`` elsewhere (as they are
        without a shortlist head)."""
        if self.tokens is None:
            return scores
        whole = scores.new_full((*scores.shape[:-1], self.vocab_size), fill)
        whole[..., self.tokens] = scores
        return whole

    def keep(self, path: Sequence[int]) -> None:
        """After :meth:`score_tree`, keep the root and the nodes of ``path`` (indices into the scored tree) in the
        cache, after the tokens read above the root; drop the rest."""
        whole, past, above = self._pending
        keep = (*range(above + 1), *(above + node for node in path))
        self.model.keep_path(self._cache, past, keep)
        self._tokens.extend(int(whole.tokens[i]) for i in keep)

    def next_scores(self, context: np.ndarray) -> torch.Tensor:
        """Logits of the token after ``context`` over the shortlist (:attr:`tokens`; the whole vocabulary without
        one), ``[len(tokens)]``; the cache then holds all of ``context``."""
        logits = self.score_tree_short(context, root_only(int(context[-1])))
        self.keep(())
        return logits[0]

    def next_logits(self, context: np.ndarray) -> torch.Tensor:
        """Logits of the token after ``context`` (``[vocab]``, ``-inf`` outside a shortlist); the cache then holds
        all of ``context``."""
        return self.spread(self.next_scores(context), -torch.inf)


def shortlist_share(model: TargetModel, head: VocabHead, repeats: int = 5) -> float:
    """The time of ``model``'s one-token forward with ``head`` over that with its whole head (at most 1; the best of
    ``repeats`` each, in turn, on scratch caches): what a shortlist leaves of a forward its cost curve measured."""
    tree = root_only(0)
    best = {None: float("inf"), "short": float("inf")}
    for _ in range(repeats):
        for key, used in ((None, None), ("short", head)):
            cache = model.new_cache()
            start = time.perf_counter()
            model.forward_tree(cache, tree, head=used)
            best[key] = min(best[key], time.perf_counter() - start)
    return min(1.0, best["short"] / best[None]) if best[None] > 0 else 1.0


def shortlist_tokens(counts: np.ndarray, size: int, always: Sequence[int] = ()) -> np.ndarray | None:
    """A draft head's shortlist: the ``size`` most frequent token ids of ``counts`` (a count per id; ties to the
    lower id), ``always`` among them (the end-of-sequence tokens), sorted. ``None`` when that would be the whole
    vocabulary (nothing to save). Example: counts ``[5, 0, 9, 1]``, size 2, always ``[3]`` → ``[2, 3]``."""
    always = np.unique(np.asarray([t for t in always if 0 <= int(t) < counts.shape[0]], dtype=np.int64))
    if size <= 0 or max(size, always.shape[0]) >= counts.shape[0]:
        return None
    order = np.argsort(-counts, kind="stable")
    rest = order[~np.isin(order, always)][: max(0, size - always.shape[0])]
    return np.sort(np.concatenate([always, rest])).astype(np.int64)
