"""Acceptance rules: which drafted tokens the target keeps, and which token it adds itself.

Every rule walks the draft tree from the root and returns a :class:`Verdict`: the accepted node path and the *bonus*
token, the target's own next token after the last accepted node. Each rule reproduces plain decoding exactly:

* :func:`accept_greedy` — follow the target's argmax; identical tokens to greedy decoding.
* :func:`accept_sampled` — for deterministic drafts: at each node draw ``x ~ p`` (the target's warped distribution)
  and descend into the child whose token is ``x``; otherwise stop with ``x``. Every emitted token is a plain draw
  from ``p``, so the output distribution is exactly the target's.
* :func:`speculative_sample` — Leviathan et al. (2023) for a drafter that supplies its own distribution ``q``:
  accept draft ``x ~ q`` with probability ``min(1, p(x) / q(x))``; on rejection resample from
  ``norm(max(p - q, 0))``. Used by draft-model drafters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hierspec.config import SamplingConfig
from hierspec.runtime.int4_kernel import loaded_kernel
from hierspec.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft tree.

    Attributes:
        tree: the verified tree.
        path: accepted node indices, root excluded, from the first draft token down.
        bonus: the target's own token after the last accepted node.
        target_argmax: the target's top-1 prediction after every node of the tree, shape ``[n]`` — tokens the
            verifier produced anyway, which drafters may recycle.
        target_topk: the target's top-k predictions after every node, ``[n, k]`` best first, when the drafter asked
            for ``k > 1`` (:attr:`hierspec.drafters.Drafter.verifier_topk`); else ``None``.
    """

    tree: DraftTree
    path: tuple[int, ...]
    bonus: int
    target_argmax: np.ndarray
    target_topk: np.ndarray | None = None

    @property
    def accepted_tokens(self) -> list[int]:
        """Accepted draft tokens followed by the bonus token: what this step adds to the output."""
        return [int(self.tree.tokens[i]) for i in self.path] + [self.bonus]

    @property
    def accepted_sources(self) -> list[str]:
        """Source of each accepted draft token."""
        return [self.tree.sources[i] for i in self.path]


def warp_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The target's sampling distribution from raw logits (last dimension = vocabulary), in float64.

    Temperature, then top-k, then top-p (nucleus: keep the most likely tokens until their mass reaches ``top_p``,
    always at least one), as transformers applies them.
    """
    scores = logits.to(torch.float64) / sampling.temperature
    vocab = scores.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p  # the token that crosses top_p is kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def accept_greedy(tree: DraftTree, logits: torch.Tensor, topk: int = 1) -> Verdict:
    """Greedy acceptance: descend while the target's argmax equals a child's token.

    ``logits`` has shape ``[n, vocab]``, row ``i`` being the target's prediction after node ``i``. ``topk > 1``
    also records the target's top-k predictions per node in the verdict.
    """
    argmax, top = _predictions(logits, topk)
    return accept_predicted(tree, argmax, top)


def accept_predicted(tree: DraftTree, argmax: np.ndarray, topk: np.ndarray | None = None) -> Verdict:
    """:func:`accept_greedy` from the target's argmax token id after every node (``[n]``; ``topk``, ``[n, k]``,
    recorded in the verdict), for a caller that found them without a whole-vocabulary row."""
    return _walk(tree, lambda node: int(argmax[node]), argmax, topk)


def accept_sampled(
    tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator, topk: int = 1
) -> Verdict:
    """Lossless acceptance of deterministic drafts under sampling.

    At each node on the walk, draw ``x`` from the target's warped distribution; if a child carries ``x`` the walk
    moves there (the draft saved a forward pass), else ``x`` is the bonus token. Only rows on the walk are warped.
    """
    argmax, top = _predictions(logits, topk)
    return _walk(tree, lambda node: sample_token(warp_probs(logits[node].cpu(), sampling), generator), argmax, top)


def accept_speculative(
    tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator, topk: int = 1
) -> Verdict:
    """Speculative sampling along a sampled chain (``tree.dists`` holds each token's draft distribution ``q``).

    Each draft token is accepted with probability ``min(1, p/q)`` (:func:`speculative_sample`); the first rejection
    ends the walk with a token from the residual; when every token passes, the bonus is a plain draw from ``p``.
    """
    if tree.dists is None or not tree.is_chain:
        raise ValueError("accept_speculative needs a chain with draft distributions")
    argmax, top = _predictions(logits, topk)
    path: list[int] = []
    for node in range(1, tree.size):
        p = warp_probs(logits[node - 1].cpu(), sampling)
        accepted, token = speculative_sample(p, tree.dists[node], int(tree.tokens[node]), generator)
        if not accepted:
            return Verdict(tree=tree, path=tuple(path), bonus=token, target_argmax=argmax, target_topk=top)
        path.append(node)
    bonus = sample_token(warp_probs(logits[tree.size - 1].cpu(), sampling), generator)
    return Verdict(tree=tree, path=tuple(path), bonus=bonus, target_argmax=argmax, target_topk=top)


def verify(tree: DraftTree, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator,
           topk: int = 1) -> Verdict:
    """The acceptance rule for this tree and sampling setting: greedy, speculative sampling for a sampled chain,
    or the deterministic-draft rule. Shared by the decoding loop and by HSDDW's middle model."""
    if sampling.greedy:
        return accept_greedy(tree, logits, topk)
    if tree.dists is not None:
        return accept_speculative(tree, logits, sampling, generator, topk)
    return accept_sampled(tree, logits, sampling, generator, topk)


def _predictions(logits: torch.Tensor, topk: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The target's argmax per row and, for ``topk > 1``, its top-k token ids per row (:func:`row_predictions`)."""
    if topk <= 1:
        compiled = _compiled_rows(logits)
        if compiled is None:
            return row_argmax(logits), None
        return compiled.row_topk(logits.detach().contiguous(), 1)[0].numpy(), None
    return row_predictions(logits, min(topk, logits.shape[-1]))


def _compiled_rows(logits: torch.Tensor):
    """The compiled extension where it reads these logits (float32 on the CPU, the int4 path's kernel loaded)."""
    return loaded_kernel() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None


def row_predictions(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's argmax (:func:`row_argmax`'s: the first maximal entry, the first NaN if any) and the indices of
    its ``k`` largest entries, largest first, ``[n]`` and ``[n, k]`` int64.

    Float32 rows on the CPU go through the compiled extension's one pass where the int4 path has loaded it: it
    finds both (PyTorch's ``topk`` took ~40 µs a 49152-entry row, there ~2 µs; NumPy's ``argmax`` another ~16 µs a
    row in a decoding step), each long row read in stretches by the threads side by side, where the head's product
    left them in their caches (right after a one-row forward on a Zen 3: NumPy's argmax ~0.10 ms, the compiled pass
    ~0.05 ms); equal values come in index order and NaN ranks as -inf in the top-k. Elsewhere the argmax is NumPy's
    and the top-k PyTorch's, whose tie order may differ — the argmax is never taken from a top-k whose tie-breaking
    is not NumPy's, so greedy acceptance matches plain greedy decoding exactly for every tree size.
    """
    compiled = _compiled_rows(logits)
    if compiled is not None:
        argmax, top = compiled.row_topk(logits.detach().contiguous(), k)
        return argmax.numpy(), top.numpy()
    return row_argmax(logits), logits.topk(k, dim=-1).indices.cpu().numpy()


def row_argmax(logits: torch.Tensor) -> np.ndarray:
    """Index of the first maximal entry of each row of ``[n, vocab]`` logits, as int64.

    On the CPU, NumPy's vectorised ``argmax`` (5 µs per 49152-entry row on the project's machine) replaces
    PyTorch's (60 µs for one row, and milliseconds for several rows when its threads contend: BENCHMARKS.md,
    "Runtime"); bfloat16 rows are widened to float32 first, which is exact.
    """
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).cpu().numpy()
    rows = logits.detach()
    if rows.dtype not in (torch.float32, torch.float64):
        rows = rows.float()
    return np.argmax(rows.numpy(), axis=-1).astype(np.int64)


def _walk(tree: DraftTree, target_token: Callable[[int], int], argmax: np.ndarray,
          topk: np.ndarray | None = None) -> Verdict:
    """Descend from the root while the target's token after the current node is one of its children."""
    path: list[int] = []
    node = 0
    while True:
        token = target_token(node)
        child = tree.children(node).get(token)
        if child is None:
            return Verdict(tree=tree, path=tuple(path), bonus=token, target_argmax=argmax, target_topk=topk)
        path.append(child)
        node = child


def speculative_sample(
    p: torch.Tensor, q: torch.Tensor, draft_token: int, generator: torch.Generator
) -> tuple[bool, int]:
    """One step of speculative sampling (Leviathan et al., 2023, algorithm 1).

    Args:
        p: target distribution at this position, shape ``[vocab]``.
        q: draft distribution the draft token was sampled from, shape ``[vocab]``.
        draft_token: the drafted token.
        generator: random source.

    Returns:
        ``(True, draft_token)`` when accepted, else ``(False, replacement)`` with the replacement drawn from the
        residual ``norm(max(p - q, 0))``. Either way the returned token is distributed exactly as ``p``.
    """
    p_x = float(p[draft_token])
    q_x = float(q[draft_token])
    # accept with probability min(1, p(x) / q(x))
    if q_x > 0 and torch.rand((), generator=generator, dtype=torch.float64).item() * q_x < p_x:
        return True, draft_token
    residual = torch.clamp(p.to(torch.float64) - q.to(torch.float64), min=0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p == q: rejection has probability zero, reachable only through rounding
        return False, sample_token(p.to(torch.float64), generator)
    return False, sample_token(residual / total, generator)
