"""Would a draft head that attends over the earlier positions (EAGLE's draft layer) guess the target's next token
better than ``hd``'s one-position head? An offline study on the target's own answers (issue 28).

Usage:
    python scripts/feature_head_study.py [--keys 120000] [--epochs 3] [--attend-epochs 8] [--work DIR]

Reads the model store's answers (``make stores``) through the target once (hidden states after the final norm, as
the ``head`` store's build does; resumable in ``--work``), then trains on the same positions and reports held-out
top-1/top-4 accuracy on the target's own predictions (the last 5 % of the answers) for:

* ``mlp`` — the ``head`` store's network (:class:`~hierspec.datastore.draft_head.DraftHead`): the hidden state at
  position ``t`` and the token at ``t + 1`` → the target's prediction at ``t + 1``;
* ``attend`` — the same inputs, projected and passed through one causal transformer layer over all earlier positions
  of the answer (no positional encoding: causal attention orders the positions itself), then the same shortlist.

Both predict over the same shortlist of the target's most frequent predictions, with the target's own output rows.
Nothing here is used by ``hd``; the figures are in ``docs/miss-study.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import hierspec
from hierspec.datastore.dense import HIDDEN_FILE, VALUES_FILE, DenseBuildConfig, embed_documents
from hierspec.datastore.draft_head import (HeadBuildConfig, _embeddings, _predictions, frequent_tokens, train_head,
                                           training_pairs)
from hierspec.datastore.format import default_store_dir
from hierspec.datastore.ngram import KIND as MODEL_KIND
from hierspec.store_builds import token_documents


class AttendingHead(torch.nn.Module):
    """``[h_t; e_{t+1}]`` → a 2H→H projection → one causal pre-norm transformer layer → RMS norm: the state whose
    product with the shortlist's output rows gives the logits."""

    def __init__(self, hidden: int, heads: int, inner: int) -> None:
        super().__init__()
        self.project = torch.nn.Linear(2 * hidden, hidden)
        self.layer = torch.nn.TransformerEncoderLayer(hidden, heads, inner, dropout=0.0, activation="gelu",
                                                      batch_first=True, norm_first=True)
        self.norm = torch.nn.RMSNorm(hidden)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = hidden + self.project(torch.cat([hidden, embedded], dim=-1))
        length = x.shape[1]
        mask = torch.triu(torch.full((length, length), float("-inf")), diagonal=1)
        return self.norm(self.layer(x, src_mask=mask, is_causal=True))


def document_spans(keys: list[int]) -> list[tuple[int, int]]:
    ends = np.cumsum(keys)
    return [(int(e - k), int(e)) for k, e in zip(keys, ends) if k > 1]


def windows(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """Row ranges of at most ``length`` rows inside each document (a window's first row sees no earlier one)."""
    return [(s, min(s + length, end)) for start, end in spans for s in range(start, end - 1, length)]


def train_attending(hidden, values, labels, train_windows, input_rows, rows, position, args) -> AttendingHead:
    torch.manual_seed(0)
    head = AttendingHead(hidden.shape[1], args.heads, args.inner)
    optimiser = torch.optim.AdamW(head.parameters(), lr=args.lr)
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    for epoch in range(args.attend_epochs):
        order = rng.permutation(len(train_windows))
        total = count = 0
        for index in order:
            h, e, y = window_batch(hidden, values, labels, train_windows[index], input_rows, position)
            logits = F.linear(head(h, e), rows)[0]
            loss = F.cross_entropy(logits, y, ignore_index=-1)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            total += loss.item() * int((y >= 0).sum())
            count += int((y >= 0).sum())
        print(f"  attend epoch {epoch + 1}: loss {total / max(count, 1):.3f} ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return head.eval()


def window_batch(hidden, values, labels, window, input_rows, position):
    """Rows ``start .. stop - 2`` as inputs (their next row's prediction is the label; -1 outside the shortlist)."""
    start, stop = window
    ids = np.arange(start, stop - 1)
    h = torch.from_numpy(np.asarray(hidden[ids], dtype=np.float32))[None]
    e = input_rows[torch.from_numpy(values[ids].astype(np.int64))][None]
    return h, e, torch.from_numpy(position[labels[ids + 1]])


@torch.inference_mode()
def attending_accuracy(head, hidden, values, labels, test_windows, input_rows, rows, position) -> dict:
    hits1 = hits4 = n = 0
    for window in test_windows:
        h, e, y = window_batch(hidden, values, labels, window, input_rows, position)
        top = torch.topk(F.linear(head(h, e), rows)[0], 4).indices
        hits1 += int((top[:, 0] == y).sum())
        hits4 += int((top == y[:, None]).any(-1).sum())
        n += y.shape[0]
    return {"pairs": n, "top1": round(hits1 / n, 4), "top4": round(hits4 / n, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=120_000)
    parser.add_argument("--epochs", type=int, default=3, help="the one-position head's (the store's default)")
    parser.add_argument("--attend-epochs", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--inner", type=int, default=1536)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--work", default="/tmp/feature-head-study")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    target = hierspec.load_model()
    model_dir = Path(default_store_dir(target.tokenizer_fingerprint)) / MODEL_KIND
    documents, keys = [], 0
    for document in token_documents(target, model_dir, "jsonl"):
        if keys >= args.keys:
            break
        documents.append(document)
        keys += document.keys
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = embed_documents(target, documents, work, DenseBuildConfig(next_tokens=1, window=512, max_keys=args.keys))
    hidden = np.memmap(work / HIDDEN_FILE, dtype=np.float16, mode="r", shape=(rows, target.hidden_size))
    values = np.fromfile(work / VALUES_FILE, dtype=np.int32, count=rows)
    output_rows, input_rows = _embeddings(target)
    labels = _predictions(hidden, output_rows)

    spans = document_spans([d.keys for d in documents])
    split = int(round(len(spans) * 0.95))
    config = HeadBuildConfig(epochs=args.epochs)
    pairs = training_pairs([d.keys for d in documents])
    test_start = spans[split][0]
    # train_head holds out the last share of its pairs: give it the same documents' split
    held_out = float(np.mean(pairs >= test_start))
    started = time.perf_counter()
    _, _, mlp = train_head(hidden, values, labels, pairs, input_rows, output_rows,
                           HeadBuildConfig(epochs=args.epochs, held_out=held_out))
    print(f"mlp: {mlp['top1']:.4f} top-1, {mlp['top4']:.4f} top-4 on {mlp['held_out_pairs']} pairs "
          f"({time.perf_counter() - started:.0f} s)", flush=True)

    train_rows = pairs[pairs < test_start]
    shortlist = frequent_tokens(labels[train_rows + 1], config.shortlist)
    position = np.full(output_rows.shape[0], -1, dtype=np.int64)
    position[shortlist] = np.arange(shortlist.shape[0])
    shortlist_rows = output_rows[torch.from_numpy(shortlist.astype(np.int64))]
    train_windows = windows(spans[:split], args.window)
    test_windows = windows(spans[split:], args.window)
    head = train_attending(hidden, values, labels, train_windows, input_rows, shortlist_rows, position, args)
    attend = attending_accuracy(head, hidden, values, labels, test_windows, input_rows, shortlist_rows, position)
    print(f"attend: {attend['top1']:.4f} top-1, {attend['top4']:.4f} top-4 on {attend['pairs']} pairs", flush=True)


if __name__ == "__main__":
    main()
