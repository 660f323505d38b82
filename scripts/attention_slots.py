"""Does CPU attention depend on where an attended key sits among masked ones? (Why branching trees are not bit-exact.)

    python scripts/attention_slots.py

One 4-row query block attends 190 cache keys and one more key; that key is placed at slot 190 (right after the
cache, where plain decoding puts it) or 1–11 slots later with masked slots between (where a breadth-first draft tree
puts a node's ancestor). Prints whether the output is bit-identical and the largest difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HEADS, DIM, KEYS, CACHE = 3, 64, 512, 190


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: int) -> torch.Tensor:
    """The queries' attention over the cache and key 400 of ``keys``/``values`` moved to ``slot``."""
    keys, values = keys.clone(), values.clone()
    keys[:, :, slot], values[:, :, slot] = keys[:, :, 400], values[:, :, 400]
    mask = torch.zeros(1, 1, query.shape[2], KEYS, dtype=torch.bool)
    mask[..., :CACHE] = True
    mask[..., slot] = True
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)


def main() -> None:
    torch.manual_seed(0)
    query = torch.randn(1, HEADS, 4, DIM)
    keys, values = torch.randn(1, HEADS, KEYS, DIM), torch.randn(1, HEADS, KEYS, DIM)
    plain = attend(query, keys, values, CACHE)
    for gap in range(1, 12):
        moved = attend(query, keys, values, CACHE + gap)
        print(f"key {gap:2d} slots later: identical {torch.equal(moved, plain)!s:5}  "
              f"max difference {(moved - plain).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
