"""Tree attention whose every row is bit-identical to the same token verified in plain decoding (``--attention
exact``).

CPU attention's sums depend on the *slots* a row's keys sit in (``scripts/attention_slots.py``): a node of a second
branch sees its ancestors at breadth-first slots, not where plain decoding puts its tokens, so its logits may differ
in the last bits and a near-tie may flip (BENCHMARKS.md, "Exact tree attention"). Here a row's arithmetic depends on
its *logical* key sequence only:

* part A — every attended key but the row's last :data:`TAIL` — through PyTorch's CPU flash attention with its
  log-sum-exp. For a row of a chain, or of any tree no deeper than ``TAIL - 1``, these keys are the cache slots
  ``0 .. B - 1``, contiguous, exactly as in plain decoding (masked keys after them add exact zeros in whole key
  blocks, :data:`~hierspec.runtime.attention.KEY_BLOCK`);
* part B — the last :data:`TAIL` attended keys, gathered per row in logical order (a row's own key is always the last
  column) — scored by batched products of one row each; part A's log-sum-exp joins them as one more column of the
  same softmax, whose first weight scales part A's output.

Both parts are computed the same way for a token alone, in a chain or anywhere in a tree, so the result is the same
bit for bit (``tests/test_exact_attention.py``). PyTorch's flash attention with log-sum-exp is a private op: it is
used in this module only, and ``test_the_private_flash_op_still_returns_output_and_log_sum_exp`` fails loudly if a
PyTorch release changes it.
"""

from __future__ import annotations

import functools
import logging

import torch

from hierspec.runtime.attention import QUERY_ROW_MULTIPLE, additive_mask

log = logging.getLogger(__name__)

#: attended keys per row computed in logical order (part B); a branching tree deeper than ``TAIL - 1`` loses
#: exactness below that depth (chains of any depth keep it)
TAIL = 16


def flash_with_log_sum_exp(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention: ``(output [b, h, q, d], log-sum-exp [b, h, q])`` (a fully masked row gives
    output 0 and log-sum-exp 0)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False, attn_mask=mask,
                                                                      scale=scale)
    return out[0], out[1]


class ExactPlan:
    """What every layer of one forward needs, made once from its boolean mask ``[rows, width]`` (True = attend).

    Attributes:
        mask_a: additive ``[1, 1, folded, width]`` mask of part A, rows folded per query head of a group and padded
            to a multiple of :data:`~hierspec.runtime.attention.QUERY_ROW_MULTIPLE`.
        index: ``[rows * TAIL]`` slots of each row's part B in logical order (slot 0 where a row has fewer keys).
        tail_bias: ``[1, rows, 1, TAIL]`` additive mask of part B; ``empty_a``: ``[1, rows, 1, 1]``, ``-inf`` where
            a row has no part A.
        deep_branches: rows whose part A is not a contiguous prefix of the slots (a branch deeper than ``TAIL - 1``):
            their results are correct but not bit-exact.
    """

    def __init__(self, mask: torch.Tensor, groups: int, dtype: torch.dtype) -> None:
        rows, width = mask.shape
        device = mask.device
        from_end = mask.sum(-1, keepdim=True) - mask.long().cumsum(-1)  # 0 at a row's last attended key
        tail = mask & (from_end < TAIL)
        part_a = mask & ~tail
        index = torch.zeros(rows, TAIL, dtype=torch.long, device=device)
        valid = torch.zeros(rows, TAIL, dtype=torch.bool, device=device)
        row, slot = tail.nonzero(as_tuple=True)
        place = TAIL - 1 - from_end[row, slot]  # right-aligned: a row's own key is always the last column
        index[row, place], valid[row, place] = slot, True
        folded = -(-groups * rows // QUERY_ROW_MULTIPLE) * QUERY_ROW_MULTIPLE
        additive = torch.full((folded, width), -torch.inf, dtype=dtype, device=device)
        additive[: groups * rows] = additive_mask(part_a, dtype).repeat(groups, 1)
        additive[groups * rows :, 0] = 0.0  # padding rows attend one key: finite, dropped
        self.mask_a = additive[None, None]
        self.index = index.reshape(-1)
        self.tail_bias = additive_mask(valid, dtype)[None, :, None, :]
        self.empty_a = additive_mask(part_a.any(-1), dtype)[None, :, None, None]
        held = part_a.sum(-1)
        prefix_end = torch.where(part_a.any(-1), width - part_a.flip(-1).long().argmax(-1), 0)
        self.deep_branches = int((held != prefix_end).sum())
        if self.deep_branches:
            _warn_deep_branches()


def exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: ExactPlan,
                    scale: float) -> torch.Tensor:
    """``query [1, heads, rows, d]`` over ``key``/``value`` ``[1, kv_heads, width, d]`` → ``[rows, heads * d]``."""
    _, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(1, kv_heads, groups * rows, dim)
    extra = plan.mask_a.shape[2] - groups * rows
    if extra:
        folded = torch.cat((folded, folded.new_zeros(1, kv_heads, extra, dim)), 2)
    out_a, lse_a = flash_with_log_sum_exp(folded, key, value, plan.mask_a, scale)
    out_a = out_a[0, :, : groups * rows].view(kv_heads, groups, rows, dim).transpose(1, 2)
    lse_a = lse_a[0, :, : groups * rows].view(kv_heads, groups, rows, 1).transpose(1, 2).to(query.dtype)
    tail_keys = key[0].index_select(1, plan.index).view(kv_heads, rows, TAIL, dim)
    tail_values = value[0].index_select(1, plan.index).view(kv_heads, rows, TAIL, dim)
    per_row = query[0].view(kv_heads, groups, rows, dim).transpose(1, 2)  # [kv_heads, rows, groups, d]
    scores = torch.matmul(per_row, tail_keys.transpose(-1, -2)).mul_(scale).add_(plan.tail_bias)
    # part A as one more column whose score is its log-sum-exp: one softmax gives both parts' weights
    weights = torch.softmax(torch.cat((lse_a.add_(plan.empty_a), scores), dim=-1), dim=-1)
    out = torch.matmul(weights[..., 1:], tail_values).addcmul_(out_a, weights[..., :1])
    return out.permute(1, 0, 2, 3).reshape(rows, heads * dim)


@functools.lru_cache(maxsize=1)
def _warn_deep_branches() -> None:
    log.warning("exact attention: a draft tree branches deeper than %d tokens; its nodes below that depth are "
                "computed correctly but may differ from plain decoding in the last bits", TAIL - 1)
