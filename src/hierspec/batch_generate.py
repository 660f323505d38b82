"""Greedy generation for many prompts per forward, for building model stores from thousands of prompts.

One prompt at a time, a 2-core CPU spends a whole forward's weight traffic on one token; a batch of prompts shares
it. Prompts are sorted by length and answered ``batch_size`` at a time: left-padded, with per-row position ids and
a mask that hides the padding, in the runtime's preallocated KV cache; rows that reach an end-of-sequence token
leave the batch. Every answer is the model's greedy continuation of its prompt, as one-at-a-time decoding gives it
(token for token on float64 models: ``tests/test_model_store.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from hierspec.accept import row_argmax
from hierspec.runtime.kv_cache import cache_argument
from hierspec.target import TargetModel

#: a batch is compacted (finished rows dropped from the cache) once this share of its rows has finished
COMPACT_SHARE = 0.25


def generate_greedy_batches(target: TargetModel, prompts: Sequence[list[int]], max_new_tokens: int,
                            batch_size: int = 16) -> Iterator[tuple[int, list[int]]]:
    """Yield ``(prompt index, answer token ids)`` for every prompt, a batch at a time (longest prompts first).

    An answer ends after its first end-of-sequence token or after ``max_new_tokens`` tokens (fewer when the
    prompt leaves less room in the context).
    """
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    for start in range(0, len(order), batch_size):
        group = order[start : start + batch_size]
        room = min(max_new_tokens, target.max_context - max(len(prompts[i]) for i in group))
        if room < 1:
            yield from ((index, []) for index in group)
            continue
        yield from zip(group, _generate_group(target, [prompts[i] for i in group], room))


@torch.inference_mode()
def _generate_group(target: TargetModel, prompts: list[list[int]], room: int) -> list[list[int]]:
    rows, width = len(prompts), max(len(p) for p in prompts)
    device = target.device
    ids = torch.zeros((rows, width), dtype=torch.long, device=device)
    valid = torch.zeros((rows, width + room), dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, device=device)
        valid[row, width - len(prompt) : width] = True
    positions = (valid[:, :width].long().cumsum(1) - 1).clamp(min=0)
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    # a padding query sees itself only, so no row of the softmax is empty
    mask = (causal & valid[:, None, :width]) | torch.eye(width, dtype=torch.bool, device=device)
    # batched rows through the model's own modules: a growing cache in the model's dtype
    cache = target.runtime.eager_cache(capacity=width + room, modules=True)
    logits = target.model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None],
                          **cache_argument(target.model, cache), use_cache=True, logits_to_keep=1).logits[:, -1]
    answers: list[list[int]] = [[] for _ in prompts]
    alive = list(range(rows))  # batch row -> prompt
    done = np.zeros(rows, dtype=bool)  # rows that produced an end-of-sequence token
    last = positions[:, -1]
    length = width
    eos = target.eos_token_ids
    for step in range(room):
        tokens = row_argmax(logits)
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                answers[alive[row]].append(token)
                done[row] = token in eos
        if done.all() or step == room - 1:
            break
        valid[: len(alive), length] = True
        length += 1
        next_ids = torch.as_tensor(tokens, device=device)[:, None]
        last = last + 1
        if done.sum() >= COMPACT_SHARE * len(alive):
            keep = np.flatnonzero(~done)
            index = torch.as_tensor(keep, device=device)
            cache.select_rows(index)
            valid, next_ids, last = valid[index], next_ids[index], last[index]
            alive, done = [alive[row] for row in keep], done[keep]
        logits = target.model(input_ids=next_ids, position_ids=last[:, None],
                              attention_mask=valid[: len(alive), None, None, :length],
                              **cache_argument(target.model, cache), use_cache=True).logits[:, -1]
    return answers
