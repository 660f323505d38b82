"""Tree attention registered through transformers' public ``AttentionInterface`` (no model file is edited).

transformers' own SDPA path copies every cached key and value ``num_key_value_groups`` times (``repeat_kv``) when a
mask is given and more than one query is verified — the whole KV cache, every layer, every verification. Here the
query heads of a group are folded into the query rows instead (what transformers does for one query only), for any
number of queries, so grouped-query models attend to the cache in place. One code path for every query count also
keeps a tree node's attention output equal to a plain decoding step's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hierspec.runtime import cuda_attention

NAME = "hierspec_tree"


#: on the CPU, SDPA computes a block of fewer than 4 query rows (per key/value head, grouped heads folded in; the
#: last block of 32, 64 or 256 rows included) on another path whose results differ in the last bit from the same
#: rows computed among more; query rows are padded to a multiple of 4, so a row's attention does not depend on how
#: many rows share the forward
QUERY_ROW_MULTIPLE = 4
#: CPU SDPA (PyTorch's flash kernel) reduces keys in blocks of this many; the last block's products are split by
#: its own width, so a row's attention depends on how many masked keys trail it unless every key view is a whole
#: number of blocks (then trailing masked keys add exact zeros). The runtimes round key views up to it; the test
#: ``test_a_chain_rows_attention_does_not_depend_on_the_masked_keys_after_it`` fails if PyTorch changes the block.
KEY_BLOCK = 512


def tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention with grouped query heads folded into rows.

    Shapes: ``query [b, heads, q, d]``, ``key``/``value`` ``[b, kv_heads, k, d]``, ``attention_mask`` ``[b|1, 1, q,
    k]`` (bool, True = attend), already folded as ``[b|1, 1, g * q, k]`` (the runtime's tree masks, folded once per
    forward rather than once per layer), ``None`` (causal when ``q == k``, else unmasked), or an int32 ``[1, 1, q,
    2 + P]`` row plan of the graphed CUDA runtime (exact attention, :mod:`~hierspec.runtime.cuda_attention`).
    Returns ``[b, q, heads, d]``.
    """
    if attention_mask is not None and attention_mask.dtype == cuda_attention.PLAN_DTYPE:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return cuda_attention.attend(query, key, value, attention_mask[0, 0], scale), None
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    if groups > 1:
        # [b, kv_heads * g, q, d] -> [b, kv_heads, g * q, d]: row j * q + i is query i of the group's j-th head
        query = query.reshape(batch, key.shape[1], groups * q_len, dim)
        if attention_mask is not None and attention_mask.shape[-2] != groups * q_len:
            attention_mask = attention_mask.repeat(1, 1, groups, 1)
    causal = attention_mask is None and q_len > 1 and groups == 1 and key.shape[2] == q_len
    if attention_mask is None and q_len > 1 and not causal:
        attention_mask = _causal_rows(q_len, key.shape[2], groups, query.device)
    rows = query.shape[2]
    if attention_mask is not None and rows % QUERY_ROW_MULTIPLE and query.device.type == "cpu":
        query, attention_mask = _pad_queries(query, attention_mask, QUERY_ROW_MULTIPLE)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal)
    out = out[:, :, :rows].reshape(batch, heads, q_len, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a boolean mask (True = attend): 0 where allowed, ``-inf`` elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, -torch.inf)


def _pad_queries(query: torch.Tensor, mask: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and mask padded to a multiple of ``multiple`` rows with zero queries that attend every key (their
    outputs are dropped)."""
    extra = -query.shape[2] % multiple
    query = torch.cat((query, query.new_zeros(*query.shape[:2], extra, query.shape[3])), dim=2)
    # True attends in a boolean mask, 0 in an additive one
    filler = mask.new_full((*mask.shape[:2], extra, mask.shape[3]), mask.dtype == torch.bool)
    return query, torch.cat((mask, filler), dim=2)


def _causal_rows(q_len: int, kv_len: int, groups: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask ``[1, 1, groups * q, kv]`` (the last query sees every key)."""
    rows = torch.arange(q_len, device=device).repeat(groups)[:, None]
    cols = torch.arange(kv_len, device=device)[None, :]
    return (cols <= rows + (kv_len - q_len))[None, None]


def register() -> str:
    """Register the attention function and its mask builder (transformers' SDPA masks) under :data:`NAME`."""
    AttentionInterface.register(NAME, tree_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
