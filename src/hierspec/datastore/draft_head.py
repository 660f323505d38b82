"""Draft-head store: a small network trained on the target's own hidden states that guesses the token after next.

A verification forward ends with the target's last hidden state ``h`` at the last accepted node and its prediction
there, the next step's root ``r``. The databases of ``hd`` then look for what follows ``r`` in text; when none of
them holds it (about three quarters of the steps that accept nothing, docs/miss-study.md) a step drafts in vain.
The head reads ``h`` and ``r`` — information those databases never see — and predicts the target's next token after
``r`` (the idea of Medusa and Hydra heads, conditioned on ``r`` as Hydra's are)::

    z = h + W2 · silu(W1 · [h ; embed(r)] + b1) + b2
    logits = rmsnorm(z) · g  @  S^T

``S`` holds the target's own output-embedding rows of a shortlist: the ``shortlist`` tokens the target predicts
most often on the training text (4,096 cover ~90 % of its predictions on ShareGPT answers; a one-row product over
all 49,152 of SmolLM2's would cost a sixth of a forward). Only ``W1``, ``b1``, ``W2``, ``b2`` and ``g`` are trained.

Building runs the target over documents (the dense store's resumable hidden-state pass, :mod:`hierspec.datastore.
dense`), labels each position ``t`` with the target's own prediction at ``t + 1`` (what greedy decoding will
verify against), keeps the pairs whose label is in the shortlist and trains with cross-entropy against the target's
whole distribution there, renormalised over the shortlist (distillation; ``distill=False``: its top-1 alone); a
held-out tail of the documents measures top-1 / top-4 accuracy, per confidence bin, written into the header.
The header records both fingerprints (tokenizer and model): hidden states are model-specific.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from hierspec.datastore.dense import (HIDDEN_FILE, PROGRESS_FILE, VALUES_FILE, DenseBuildConfig, TokenDocument,
                                      embed_documents, limit_keys, read_model_specific)
from hierspec.datastore.format import DatastoreError, new_header, open_array, write_array, write_header
from hierspec.datastore.output import (BUILD_FILE, check_replaceable, claimed_output, put_in_place,
                                       resumable_work_dir)
from hierspec.errors import InputError

KIND = "head"
#: confidence bins of a head guess by its probability (the scored tree learns a rate per bin)
PROBABILITY_BINS = (0.5, 0.25, 0.1)


@dataclass(frozen=True)
class HeadBuildConfig:
    """Draft-head builder settings.

    Attributes:
        max_keys: training positions taken from the inputs (the hidden-state pass dominates the build: SmolLM2-135M
            reads ~700 positions a second on two cores).
        shortlist: tokens the head can predict (the target's most frequent predictions on the inputs).
        width: hidden units of the head's layer.
        epochs, batch, lr: training (AdamW).
        distill: teach the target's whole distribution over the shortlist at the next position (the softmax of its
            logits there) instead of its top-1 token alone: with the same 300,000 SmolLM2 positions, held-out top-1
            on the model's own answers 42.9 % against 40.5 % (BENCHMARKS.md, "Forty-sixth session").
        held_out: share of the documents (the last ones) kept out of training to measure accuracy.
        window, batch_tokens: the hidden-state pass, as for a dense store.
        seed: shuffling and initialisation.
    """

    max_keys: int = 300_000
    shortlist: int = 4096
    width: int = 576
    epochs: int = 3
    batch: int = 256
    lr: float = 1e-3
    distill: bool = True
    held_out: float = 0.05
    window: int = 512
    batch_tokens: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.max_keys, self.shortlist, self.width, self.epochs, self.batch, self.window,
               self.batch_tokens) < 1:
            raise InputError("a draft head needs max_keys, shortlist, width, epochs, batch, window and batch_tokens "
                             ">= 1")
        if not (0.0 < self.held_out < 0.5 and self.lr > 0):
            raise InputError("a draft head needs 0 < held_out < 0.5 and lr > 0")

    def hidden_pass(self) -> DenseBuildConfig:
        """The dense store's hidden-state pass with these windows (one next token stored per position)."""
        return DenseBuildConfig(next_tokens=1, window=self.window, batch_tokens=self.batch_tokens,
                                max_keys=self.max_keys)


class DraftHead(torch.nn.Module):
    """``z = h + W2 silu(W1 [h; e] + b1) + b2``, then RMS norm with gain ``g``: the state whose product with the
    shortlist's output embeddings gives the head's logits."""

    def __init__(self, hidden: int, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.up = torch.nn.Linear(2 * hidden, width)
        self.down = torch.nn.Linear(width, hidden)
        self.gain = torch.nn.Parameter(torch.ones(hidden))
        self.eps = eps
        torch.nn.init.zeros_(self.down.weight)  # starts as the identity on h
        torch.nn.init.zeros_(self.down.bias)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The state ``z``, normalised (training; decoding runs the same in :meth:`HeadStore.guess`' NumPy step)."""
        z = hidden + self.down(F.silu(self.up(torch.cat([hidden, embedded], dim=-1))))
        return F.rms_norm(z, (z.shape[-1],), self.gain, self.eps)


# ----------------------------------------------------------------------------------------------- the store
class HeadStore:
    """A trained draft head with its shortlist: :meth:`guess` the target's next tokens after a root."""

    def __init__(self, directory: Path, header: dict, head: DraftHead, shortlist: np.ndarray,
                 rows: torch.Tensor) -> None:
        self.directory, self.header, self.head = directory, header, head
        self.shortlist = shortlist
        self.rows = rows
        self._gain = head.gain.detach().numpy().copy()
        self._products = self._float_products()  # up, down and shortlist products: float32 or int4 kernels
        self._compiled: _CompiledGuess | None = None  # the whole guess in one call (:meth:`use_kernels`)

    @classmethod
    def open(cls, directory: str | Path, target=None) -> HeadStore:
        """Open and validate a store; with ``target``, refuse one built with another tokenizer or model."""
        directory = Path(directory)
        header, arrays = read_model_specific(directory, KIND, target)
        weights = {name: np.array(open_array(directory, arrays.get(name), ("<f4",), ndim=ndim))
                   for name, ndim in (("up.weight", 2), ("up.bias", 1), ("down.weight", 2), ("down.bias", 1),
                                      ("gain", 1), ("rows", 2))}
        shortlist = np.array(open_array(directory, arrays.get("shortlist"), ("<i4",), ndim=1))
        hidden, width = weights["down.weight"].shape
        if (weights["up.weight"].shape != (width, 2 * hidden) or weights["rows"].shape != (shortlist.shape[0], hidden)
                or not all(np.isfinite(w).all() for w in weights.values())):
            raise DatastoreError(f"{directory}: the head's arrays disagree in shape or are not finite; rebuild it")
        vocab = header.get("vocab_size")
        if shortlist.size and (shortlist.min() < 0 or (isinstance(vocab, int) and shortlist.max() >= vocab)):
            raise DatastoreError(f"{directory}: shortlist tokens outside the vocabulary; rebuild the store")
        if target is not None and hidden != target.hidden_size:
            raise DatastoreError(f"{directory}: a head for hidden size {hidden}, the target's is "
                                 f"{target.hidden_size}; rebuild it")
        head = DraftHead(hidden, width, float(header.get("eps", 1e-5)))
        head.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items() if k != "rows"})
        head.eval()
        return cls(directory, header, head, shortlist, torch.from_numpy(weights.pop("rows")))

    @property
    def hidden_size(self) -> int:
        return int(self.rows.shape[1])

    def use_kernels(self, kernels) -> None:
        """Run the head's three products on the int4 path's kernels (``Int4Kernels``), its weights rounded to
        ``Q8_0`` (a quarter of float32's bytes: in a decoding step the weights come from memory, not cache, and on
        SmolLM2 the float32 head took ~1 ms of a 13 ms step) — with the whole guess in one compiled call where the
        extension is loaded (:class:`_CompiledGuess`); ``None`` goes back to float32."""
        from hierspec.runtime import int4_kernel
        from hierspec.runtime.quantized import GROUP, ROW_MULTIPLE, Int4Projection, quantize_q8_0

        head = self.head
        self._compiled = None
        if kernels is None or self.hidden_size % GROUP or head.up.out_features % GROUP:
            self._products = self._float_products()  # the kernels take inputs (2 x hidden, width, hidden) in 32s
            return

        def projection(weight: torch.Tensor, bias: torch.Tensor | None) -> Int4Projection:
            padding = -weight.shape[0] % ROW_MULTIPLE  # the kernels pack outputs in tiles of 16 rows
            if padding:
                weight = torch.cat([weight, weight.new_zeros(padding, weight.shape[1])])
                bias = None if bias is None else torch.cat([bias, bias.new_zeros(padding)])
            return Int4Projection([quantize_q8_0(weight.detach())], [None if bias is None else bias.detach()],
                                  kernel=kernels.four_bit, eight_bit=kernels.eight_bit)

        def first(product: Int4Projection, outputs: int):
            return lambda rows: product(rows)[0][:, :outputs]

        up = projection(head.up.weight, head.up.bias)
        down = projection(head.down.weight, head.down.bias)
        rows = projection(self.rows, None)
        self._products = (first(up, head.up.out_features), first(down, self.hidden_size),
                          first(rows, self.rows.shape[0]))
        module = int4_kernel.loaded_kernel()
        if module is not None and hasattr(module, "head_guess"):
            self._compiled = _CompiledGuess(module, up, down, rows, head.up.out_features, self.rows.shape[0],
                                            head.gain.detach().float().contiguous(), head.eps)

    def _float_products(self) -> tuple:
        return self.head.up, self.head.down, lambda state: F.linear(state, self.rows)

    @torch.inference_mode()
    def guess(self, hidden: np.ndarray, embedded: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most likely next tokens (ids) and their probabilities after the root whose input embedding
        is ``embedded``, from the target's hidden state ``hidden`` where it predicted that root.

        On the int4 kernels the whole guess is one compiled call; otherwise the few elementwise operations run in
        NumPy: on one row each PyTorch operator cost ~10-50 us of dispatch and thread wake-ups right after a
        forward, together more than the three products."""
        k = min(k, self.shortlist.shape[0])
        if self._compiled is not None:
            positions, probabilities = self._compiled(hidden, embedded, k)
            return self.shortlist[positions[0]], probabilities[0]
        hidden = np.asarray(hidden, dtype=np.float32).reshape(1, -1)
        up, down, rows = self._products
        embedded = torch.as_tensor(embedded, dtype=torch.float32).reshape(1, -1).numpy()
        inner = _product(up, np.concatenate([hidden, embedded], axis=1))
        inner *= 0.5 * (1.0 + np.tanh(0.5 * inner))  # SiLU: x · sigmoid(x), without exp's overflow
        state = hidden + _product(down, inner)
        state *= self._gain / np.sqrt(np.mean(state * state, axis=1, keepdims=True) + self.head.eps)
        top, probabilities = top_probabilities(_product(rows, state)[0], k)
        return self.shortlist[top], probabilities

    def verify(self) -> dict:
        """Opening reads every array and checks shapes, finiteness and the shortlist's range; report what it holds."""
        return {"shortlist": int(self.shortlist.shape[0]), "width": int(self.head.up.out_features), "ok": True}

    def info(self) -> dict:
        files = sorted(p for p in self.directory.iterdir() if p.is_file())
        return {**self.header, "bytes_on_disk": sum(p.stat().st_size for p in files)}


class _CompiledGuess:
    """:meth:`HeadStore.guess` as one call of the compiled extension's ``head_guess`` (``head_guess.cpp``): the same
    three products on the same kernels, the element-wise steps in C++ (within float32 rounding of NumPy's), each row's
    ``k`` best shortlist positions (equal logits in position order) and their softmax probabilities."""

    def __init__(self, module, up, down, rows, width: int, size: int, gain: torch.Tensor, eps: float) -> None:
        self._call = module.head_guess
        self._up, self._down, self._rows = up, down, rows
        self._width, self._size = width, size
        self._gain, self._eps = gain, float(eps)

    def __call__(self, hidden: np.ndarray, embedded: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Shortlist positions ``[rows, k]`` and probabilities ``[rows, k]`` for hidden states ``[rows, h]`` (or
        ``[h]``) and the roots' embeddings alike."""
        hidden = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32)).reshape(-1, self._gain.shape[0])
        embedded = torch.as_tensor(embedded, dtype=torch.float32).reshape(hidden.shape)
        positions, probabilities = self._call(hidden, embedded, self._up.native, self._up.bias, self._width,
                                              self._down.native, self._down.bias, self._gain, self._eps,
                                              self._rows.native, self._size, k)
        return positions.numpy(), probabilities.numpy()


def _product(product, rows: np.ndarray) -> np.ndarray:
    return product(torch.from_numpy(rows)).numpy()


def top_probabilities(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest entries' positions in ``logits``, largest first, and their softmax probabilities.

    Example: ``[0, ln 3, ln 2, ln 2]``, ``k = 2`` → positions ``[1, 2]`` or ``[1, 3]``, probabilities
    ``[0.375, 0.25]``.
    """
    k = min(k, logits.shape[0])
    top = np.argpartition(logits, logits.shape[0] - k)[-k:]
    top = top[np.argsort(-logits[top], kind="stable")]
    peak = logits[top[0]]
    return top, np.exp(logits[top] - peak) / np.exp(logits - peak).sum()


def probability_bin(probability: float) -> int:
    """Confidence bin of a guess: probability >= 0.5 → 0, >= 0.25 → 1, >= 0.1 → 2, less → 3."""
    for i, edge in enumerate(PROBABILITY_BINS):
        if probability >= edge:
            return i
    return len(PROBABILITY_BINS)


# ----------------------------------------------------------------------------------------------- building
def build_head_store(target, documents: Iterable[TokenDocument], out_dir: str | Path, config: HeadBuildConfig,
                     sources: Iterable[str] = (), overwrite: bool = False) -> dict:
    """Train a draft head on ``target``'s hidden states over ``documents``; return the store's header.

    The hidden-state pass resumes after an interruption (same inputs and settings), as a dense store's does.
    """
    with claimed_output(out_dir) as out_dir:
        check_replaceable(out_dir, overwrite)
        sources = list(sources)
        pass_config = config.hidden_pass()
        documents = list(limit_keys(documents, pass_config.max_keys))
        if not documents:
            raise InputError("nothing to train on: the inputs hold no document of two or more tokens")
        params = {"model": target.model_fingerprint, "config": asdict(config), "sources": sources,
                  "documents": len(documents), "keys": sum(d.keys for d in documents), "kind": KIND}
        start = time.perf_counter()
        work = resumable_work_dir(out_dir, params, restart=overwrite)
        rows = embed_documents(target, documents, work, pass_config)
        hidden = np.memmap(work / HIDDEN_FILE, dtype=np.float16, mode="r", shape=(rows, target.hidden_size))
        values = np.fromfile(work / VALUES_FILE, dtype=np.int32, count=rows)
        output_rows, input_rows = _embeddings(target)
        pairs = training_pairs([d.keys for d in documents])
        labels = _predictions(hidden, output_rows)
        head, shortlist, accuracy = train_head(hidden, values, labels, pairs, input_rows, output_rows, config)
        header = _write(target, work, head, shortlist, output_rows, accuracy, config, sources, len(pairs),
                        seconds=time.perf_counter() - start)
        del hidden
        for name in (HIDDEN_FILE, VALUES_FILE, PROGRESS_FILE, BUILD_FILE):
            (work / name).unlink(missing_ok=True)
        put_in_place(work, out_dir, overwrite)
    return header


def training_pairs(keys_per_document: list[int]) -> np.ndarray:
    """Row ids ``r`` whose next row ``r + 1`` is the next position of the same document (``[pairs]``): the head
    reads row ``r``'s hidden state and next token and is taught row ``r + 1``'s prediction.

    Example: documents of 3 and 2 keys (rows 0-2 and 3-4) → ``[0, 1, 3]``.
    """
    ends = np.cumsum(keys_per_document)
    starts = ends - np.asarray(keys_per_document)
    return np.concatenate([np.arange(s, e - 1) for s, e in zip(starts, ends) if e - s > 1] or [np.zeros(0, int)])


def _embeddings(target) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's output and input embedding matrices, float32."""
    return target.model.get_output_embeddings().weight.detach().to("cpu", torch.float32), target.input_embeddings()


def _predictions(hidden: np.ndarray, output_rows: torch.Tensor, chunk: int = 4096) -> np.ndarray:
    """The target's top-1 prediction at every row (its LM head over the stored hidden states)."""
    out = np.empty(hidden.shape[0], dtype=np.int64)
    with torch.inference_mode(), tqdm(total=hidden.shape[0], unit="key", desc="target predictions",
                                      dynamic_ncols=True) as bar:
        for s in range(0, hidden.shape[0], chunk):
            block = torch.from_numpy(np.asarray(hidden[s : s + chunk], dtype=np.float32))
            out[s : s + block.shape[0]] = (block @ output_rows.T).argmax(-1).numpy()
            bar.update(block.shape[0])
    return out


def shortlist_distribution(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution renormalised over the shortlist (``rows``: its tokens' output
    embeddings), from its final hidden states ``[n, hidden]``: the distillation targets ``[n, shortlist]``."""
    return torch.softmax(F.linear(hidden, rows), dim=-1)


def frequent_tokens(labels: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` most frequent labels, most frequent first (ties by token id). Example: ``[3, 1, 3, 2, 1, 3]``,
    2 → ``[3, 1]``."""
    counts = np.bincount(labels)
    seen = np.flatnonzero(counts)
    order = np.lexsort((seen, -counts[seen]))
    return seen[order][:n].astype(np.int32)


def train_head(hidden: np.ndarray, values: np.ndarray, labels: np.ndarray, pairs: np.ndarray,
               input_rows: torch.Tensor, output_rows: torch.Tensor, config: HeadBuildConfig
               ) -> tuple[DraftHead, np.ndarray, dict]:
    """Train on ``pairs`` (row ``r``: hidden ``r``, next token ``values[r]`` → label ``labels[r + 1]``); the last
    ``held_out`` share of pairs measures accuracy. Returns the head, its shortlist and the accuracy report."""
    split = int(round(pairs.shape[0] * (1 - config.held_out)))
    train, test = pairs[:split], pairs[split:]
    if train.shape[0] == 0 or test.shape[0] == 0:
        raise InputError(f"too few positions to train a draft head ({pairs.shape[0]} pairs)")
    shortlist = frequent_tokens(labels[train + 1], config.shortlist)
    position = np.full(output_rows.shape[0], -1, dtype=np.int64)
    position[shortlist] = np.arange(shortlist.shape[0])
    train = train[position[labels[train + 1]] >= 0]
    rows = output_rows[torch.from_numpy(shortlist.astype(np.int64))]
    torch.manual_seed(config.seed)
    head = DraftHead(hidden.shape[1], config.width)
    optimiser = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)

    def batch(ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.from_numpy(np.asarray(hidden[ids], dtype=np.float32))
        e = input_rows[torch.from_numpy(values[ids].astype(np.int64))]
        return h, e, torch.from_numpy(position[labels[ids + 1]])

    def taught(ids: np.ndarray, top1: torch.Tensor) -> torch.Tensor:
        """What the head is taught for rows ``ids``: the target's distribution at the next rows, or its top-1."""
        if not config.distill:
            return top1
        return shortlist_distribution(torch.from_numpy(np.asarray(hidden[ids + 1], dtype=np.float32)), rows)

    rng = np.random.default_rng(config.seed)
    steps = config.epochs * -(-train.shape[0] // config.batch)
    with tqdm(total=steps, unit="batch", desc="draft head", dynamic_ncols=True) as bar:
        for _ in range(config.epochs):
            order = rng.permutation(train)
            for s in range(0, order.shape[0], config.batch):
                ids = np.sort(order[s : s + config.batch])
                h, e, y = batch(ids)
                loss = F.cross_entropy(F.linear(head(h, e), rows), taught(ids, y))
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.2f}", refresh=False)
    head.eval()
    return head, shortlist, _accuracy(head, rows, batch, test, position, labels)


@torch.inference_mode()
def _accuracy(head: DraftHead, rows: torch.Tensor, batch, test: np.ndarray, position: np.ndarray,
              labels: np.ndarray) -> dict:
    """Top-1 and top-4 accuracy on held-out pairs (labels outside the shortlist count as misses), and per
    confidence bin its share of guesses and their top-1 accuracy."""
    hits1 = hits4 = 0
    bins = np.zeros((len(PROBABILITY_BINS) + 1, 2))
    for s in range(0, test.shape[0], 4096):
        ids = test[s : s + 4096]
        h, e, y = batch(ids)
        probs = torch.softmax(F.linear(head(h, e), rows), dim=-1)
        top = torch.topk(probs, min(4, probs.shape[1]))
        right = top.indices[:, 0] == y
        hits1 += int(right.sum())
        hits4 += int((top.indices == y[:, None]).any(-1).sum())
        for p, ok in zip(top.values[:, 0].tolist(), right.tolist()):
            bins[probability_bin(p)] += (1, ok)
    n = test.shape[0]
    return {"held_out_pairs": int(n), "top1": round(hits1 / n, 4), "top4": round(hits4 / n, 4),
            "by_confidence": [{"share": round(c / n, 4), "top1": round(h / c, 4) if c else None}
                              for c, h in bins.tolist()]}


def _write(target, work: Path, head: DraftHead, shortlist: np.ndarray, output_rows: torch.Tensor, accuracy: dict,
           config: HeadBuildConfig, sources: list[str], pairs: int, seconds: float) -> dict:
    state = {k: v.detach().numpy().astype(np.float32) for k, v in head.state_dict().items()}
    state["rows"] = output_rows[torch.from_numpy(shortlist.astype(np.int64))].numpy().astype(np.float32)
    arrays = {name: write_array(work, f"{name}.f32", array) for name, array in state.items()}
    arrays["shortlist"] = write_array(work, "shortlist.i32", shortlist.astype(np.int32))
    header = new_header(
        KIND, target.name, target.tokenizer_fingerprint,
        model={"name": target.name, "fingerprint": target.model_fingerprint, "hidden_size": target.hidden_size},
        vocab_size=target.vocab_size, eps=head.eps, pairs=pairs, accuracy=accuracy, arrays=arrays,
        sources=sources, build={**asdict(config), "seconds": round(seconds, 1)},
    )
    write_header(work, header)
    return header


def open_head_store(directory: str | Path, target=None) -> HeadStore:
    """:meth:`HeadStore.open` as a function, for symmetry with the other store kinds."""
    return HeadStore.open(directory, target)
