"""Dense datastore (DReSD, Gritta et al., 2025, section 3): the target's hidden states as keys, next tokens as values.

Building runs the target over token documents in batches and keeps the last hidden state (the LM head's input) at
every indexed position ``t`` with the next ``N`` tokens ``x[t+1 .. t+N]`` as its value. A sample of at most
``sample`` vectors estimates the z-normalisation (mean, standard deviation) and fits a PCA; every key is then
z-normalised, projected on the first ``pca_dim`` principal components and L2-normalised, and stored in a FAISS
inner-product index (so search ranks by cosine similarity). A query goes through the same :class:`KeyNormaliser`.

Hidden states are model-specific: the header records the model's fingerprint (architecture and weights, see
:func:`~hierspec.loading.model_fingerprint`) besides the tokenizer's, and a store of another model is refused.

The build works in ``.<name>.partial/`` beside the output directory and renames it into place at the end. The
slow part — the hidden states — is appended batch by batch with a progress file, so an interrupted build resumes
where it stopped; resuming with other inputs or settings is refused.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from hierspec.datastore.format import (
    DatastoreError,
    check_tokenizer,
    header_dict,
    new_header,
    open_array,
    read_header,
    write_array,
    write_header,
)
from hierspec.datastore.output import (
    BUILD_FILE,
    check_replaceable,
    claimed_output,
    put_in_place,
    resumable_work_dir,
    write_json_atomic,
)
from hierspec.errors import InputError

log = logging.getLogger(__name__)

KIND = "dense"
INDEX_TYPES = ("hnsw", "ivf", "flat")
INDEX_FILE = "keys.faiss"
PROGRESS_FILE = "progress.json"
HIDDEN_FILE = "hidden.f16"
VALUES_FILE = "values.i32"
PAD = -1
_EPS = 1e-6


@dataclass(frozen=True)
class DenseBuildConfig:
    """Dense-store builder settings.

    Attributes:
        pca_dim: dimensions kept by the PCA (the paper's choice: 64).
        next_tokens: ``N``, tokens stored after each key (the longest draft the store can give).
        index: FAISS index type: ``hnsw`` (graph, fast approximate), ``ivf`` (inverted lists) or ``flat`` (exact).
        window: most tokens per forward pass; longer documents are cut into overlapping windows, each key seeing
            at least half a window of its preceding text.
        batch_tokens: most tokens (padding included) per batch of windows.
        sample: most vectors used to estimate the normalisation and fit the PCA (the paper: ~1 M).
        max_keys: stop after this many keys (``None``: the whole input).
        hnsw_m: neighbours per HNSW node.
        ivf_lists: IVF lists (``None``: about 4 √n).
        seed: seed of the normalisation sample.
    """

    pca_dim: int = 64
    next_tokens: int = 20
    index: str = "hnsw"
    window: int = 512
    batch_tokens: int = 4096
    sample: int = 1_000_000
    max_keys: int | None = None
    hnsw_m: int = 32
    ivf_lists: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.index not in INDEX_TYPES:
            raise InputError(f"unknown index type {self.index!r}; use one of {', '.join(INDEX_TYPES)}")
        if min(self.pca_dim, self.next_tokens, self.sample, self.hnsw_m) < 1:
            raise InputError("a dense store needs pca_dim, next_tokens, sample and hnsw_m >= 1")
        if self.window < 8 or self.batch_tokens < self.window:
            raise InputError("a dense store needs window >= 8 and batch_tokens >= window")
        if self.max_keys is not None and self.max_keys < 1:
            raise InputError("max_keys must be >= 1")


@dataclass(frozen=True)
class TokenDocument:
    """Token ids of one document; positions from ``index_from`` on (whose next token exists) become keys.

    ``index_from`` > 0 keeps a prompt as context without indexing it, e.g. for the model's own answers.
    """

    ids: np.ndarray
    index_from: int = 0

    @property
    def keys(self) -> int:
        return max(0, len(self.ids) - 1 - self.index_from)


# ----------------------------------------------------------------------------------------------- normalisation
@dataclass(frozen=True)
class KeyNormaliser:
    """z-normalisation, PCA projection and L2 normalisation of hidden states (DReSD equations 1–2 and 3.4).

    Attributes:
        mean: ``[hidden]`` per-dimension mean.
        std: ``[hidden]`` per-dimension standard deviation (ε added).
        components: ``[hidden, pca_dim]`` principal directions of the z-normalised vectors, by explained variance.
    """

    mean: np.ndarray
    std: np.ndarray
    components: np.ndarray

    @property
    def dim(self) -> int:
        return int(self.components.shape[1])

    def reduce(self, vectors: np.ndarray) -> np.ndarray:
        """z-normalise and project: ``[n, hidden]`` → ``[n, pca_dim]``."""
        z = (np.asarray(vectors, dtype=np.float32) - self.mean) / self.std
        return z @ self.components

    def reconstruct(self, reduced: np.ndarray) -> np.ndarray:
        """Map reduced vectors back to hidden-state space (exact for vectors in the PCA's span)."""
        return (np.asarray(reduced, dtype=np.float32) @ self.components.T) * self.std + self.mean

    def keys(self, vectors: np.ndarray) -> np.ndarray:
        """Search keys: reduced and L2-normalised, float32 ``[n, pca_dim]``."""
        reduced = self.reduce(np.atleast_2d(vectors))
        norms = np.linalg.norm(reduced, axis=1, keepdims=True)
        return np.ascontiguousarray(reduced / np.maximum(norms, _EPS), dtype=np.float32)


def fit_normaliser(sample: np.ndarray, pca_dim: int) -> tuple[KeyNormaliser, np.ndarray]:
    """Fit the normalisation on ``[n, hidden]`` vectors; return it and the explained-variance ratio per component.

    Each component's sign is fixed (its largest entry positive), so fitting the same data twice gives the same keys.
    """
    sample = np.asarray(sample, dtype=np.float64)
    if sample.ndim != 2 or sample.shape[0] < 2:
        raise InputError("fitting the dense normalisation needs at least two vectors")
    if not 1 <= pca_dim <= sample.shape[1]:
        raise InputError(f"pca_dim must lie in [1, {sample.shape[1]}] (the hidden size), got {pca_dim}")
    mean = sample.mean(axis=0)
    std = np.sqrt(sample.var(axis=0) + _EPS)
    z = (sample - mean) / std
    covariance = z.T @ z / (z.shape[0] - 1)
    eigenvalues, eigenvectors = np.linalg.eigh(covariance)
    order = np.argsort(eigenvalues)[::-1][:pca_dim]
    components = eigenvectors[:, order]
    signs = np.sign(components[np.abs(components).argmax(axis=0), np.arange(pca_dim)])
    components *= np.where(signs == 0, 1.0, signs)
    explained = np.clip(eigenvalues[order], 0, None) / max(float(np.clip(eigenvalues, 0, None).sum()), _EPS)
    return KeyNormaliser(mean.astype(np.float32), std.astype(np.float32), components.astype(np.float32)), explained


# ----------------------------------------------------------------------------------------------- FAISS index
def make_index(kind: str, dim: int, train: np.ndarray, config: DenseBuildConfig):
    """An empty (trained, for IVF) inner-product FAISS index for ``dim``-dimensional unit keys."""
    import faiss

    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        return index
    lists = config.ivf_lists or max(1, min(int(4 * np.sqrt(train.shape[0])), train.shape[0] // 39 or 1))
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
    index.train(train)
    return index


def set_search_effort(index, ef_search: int, nprobe: int) -> None:
    """HNSW's ``efSearch`` / IVF's ``nprobe`` (ignored by flat indexes)."""
    if hasattr(index, "hnsw"):
        index.hnsw.efSearch = ef_search
    if hasattr(index, "nprobe"):
        index.nprobe = nprobe


# ----------------------------------------------------------------------------------------------- the store
class DenseStore:
    """A built dense store: :meth:`search` a raw hidden state, read the next tokens of the neighbours."""

    def __init__(self, directory: Path, header: dict, normaliser: KeyNormaliser, index, values: np.ndarray) -> None:
        self.directory = directory
        self.header = header
        self.normaliser = normaliser
        self.index = index
        self.values = values

    @classmethod
    def open(cls, directory: str | Path, target=None) -> DenseStore:
        """Open and validate a store; with ``target`` (a :class:`~hierspec.target.TargetModel`), refuse a store
        built with another tokenizer or model."""
        import faiss

        directory = Path(directory)
        header, arrays = read_model_specific(directory, KIND, target)
        mean, std, components = (np.array(open_array(directory, arrays.get(k), ("<f4",), ndim=n))
                                 for k, n in (("mean", 1), ("std", 1), ("components", 2)))
        if not (mean.shape == std.shape == components.shape[:1]) or not all(
                np.isfinite(a).all() for a in (mean, std, components)):
            raise DatastoreError(f"{directory}: the normalisation arrays disagree in shape or are not finite; "
                                 "rebuild the store")
        normaliser = KeyNormaliser(mean, std, components)
        values = open_array(directory, arrays.get("values"), ("<i4",), ndim=2)
        index_entry = header_dict(header, "index", directory)
        index_name, index_bytes = index_entry.get("file", INDEX_FILE), index_entry.get("bytes")
        if not isinstance(index_name, str) or "/" in index_name or index_name in {"", ".", ".."}:
            raise DatastoreError(f"{directory}: index file {index_name!r} is not a plain file name inside the store")
        index_path = directory / index_name
        if not index_path.is_file() or index_path.stat().st_size != index_bytes:
            raise DatastoreError(f"{index_path} is missing or has the wrong size: the store is corrupt; rebuild it")
        try:
            index = faiss.read_index(str(index_path))
        except RuntimeError as exc:
            raise DatastoreError(f"{index_path} is not a readable FAISS index: {exc}") from exc
        if index.ntotal != values.shape[0] or index.d != normaliser.dim:
            raise DatastoreError(f"{directory}: the index holds {index.ntotal} keys of {index.d} dims but the store "
                                 f"has {values.shape[0]} values and {normaliser.dim} PCA dims; rebuild it")
        store = cls(directory, header, normaliser, index, values)
        if target is not None:  # opened for generation: the values are small, check their range now
            store.verify(target.vocab_size)
        return store

    def verify(self, vocab_size: int | None = None) -> dict:
        """Read every value: token ids in ``[0, vocab_size)`` (when given) or the padding ``-1``."""
        values = np.asarray(self.values)
        low = int(values.min()) if values.size else 0
        high = int(values.max()) if values.size else 0
        if low < PAD or (vocab_size is not None and high >= vocab_size):
            raise DatastoreError(f"{self.directory}: stored next tokens range over [{low}, {high}], outside the "
                                 "vocabulary; rebuild the store")
        return {"keys": self.size, "ok": True}

    @property
    def size(self) -> int:
        return int(self.values.shape[0])

    @property
    def next_tokens(self) -> int:
        return int(self.values.shape[1])

    def search(self, hidden: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Cosine similarities and row ids of the ``k`` nearest keys to one raw hidden state (best first;
        approximate indexes may return fewer)."""
        scores, rows = self.index.search(self.normaliser.keys(hidden), k)
        found = rows[0] >= 0
        return scores[0][found], rows[0][found]

    def info(self) -> dict:
        """Header plus sizes on disk."""
        files = sorted(p for p in self.directory.iterdir() if p.is_file())
        return {**self.header, "keys": self.size, "bytes_on_disk": sum(p.stat().st_size for p in files)}


def read_model_specific(directory: Path, kind: str, target=None) -> tuple[dict, dict]:
    """The header and its ``arrays`` entry of a store of ``kind`` built from a model's hidden states; with
    ``target``, a store of another tokenizer or model is refused."""
    header = read_header(directory, kind)
    if target is not None:
        check_tokenizer(header, directory, target.tokenizer_fingerprint, target.name)
        check_model(header, directory, target.model_fingerprint, target.name)
    return header, header_dict(header, "arrays", directory)


def check_model(header: dict, directory: Path, fingerprint: str, model_name: str) -> None:
    """Refuse a store of another model's hidden states, naming the model that built it."""
    built = header.get("model", {})
    if built.get("fingerprint") != fingerprint:
        raise DatastoreError(
            f"{directory} holds hidden states of model {built.get('name')!r} (fingerprint {built.get('fingerprint')}),"
            f" but the target is {model_name!r} (fingerprint {fingerprint}); hidden states are model-specific: "
            "rebuild the dense store with this model"
        )


# ----------------------------------------------------------------------------------------------- building
def build_dense_store(target, documents: Iterable[TokenDocument], out_dir: str | Path, config: DenseBuildConfig,
                      sources: Iterable[str] = (), overwrite: bool = False) -> dict:
    """Build a dense store of ``target``'s hidden states over ``documents``; return its header.

    Resumes an interrupted build of the same inputs and settings (see the module docstring).
    """
    if config.pca_dim > target.hidden_size:
        raise InputError(f"--pca-dim {config.pca_dim} exceeds the model's hidden size {target.hidden_size}")
    with claimed_output(out_dir) as out_dir:
        check_replaceable(out_dir, overwrite)
        sources = list(sources)
        documents = list(limit_keys(documents, config.max_keys))
        if not documents:
            raise InputError("nothing to index: the inputs hold no document of two or more tokens")
        params = {"model": target.model_fingerprint, "config": asdict(config), "sources": sources,
                  "documents": len(documents), "keys": sum(d.keys for d in documents)}
        start = time.perf_counter()
        work = resumable_work_dir(out_dir, params, restart=overwrite)
        rows = embed_documents(target, documents, work, config)
        hidden = np.memmap(work / HIDDEN_FILE, dtype=np.float16, mode="r", shape=(rows, target.hidden_size))
        rng = np.random.default_rng(config.seed)
        sample_rows = np.sort(rng.choice(rows, size=min(rows, config.sample), replace=False))
        normaliser, explained = fit_normaliser(np.asarray(hidden[sample_rows], dtype=np.float32), config.pca_dim)
        index = _index_keys(hidden, normaliser, sample_rows, config)
        header = _finish(target, work, index, normaliser, explained, rows, config, sources,
                         seconds=time.perf_counter() - start)
        del hidden
        (work / HIDDEN_FILE).unlink()
        for name in (PROGRESS_FILE, BUILD_FILE):
            (work / name).unlink(missing_ok=True)
        put_in_place(work, out_dir, overwrite)
    return header


def limit_keys(documents: Iterable[TokenDocument], max_keys: int | None) -> Iterator[TokenDocument]:
    total = 0
    for doc in documents:
        if doc.keys <= 0:
            continue
        if max_keys is not None and total + doc.keys > max_keys:
            room = max_keys - total
            if room > 0:
                yield TokenDocument(doc.ids[: doc.index_from + room + 1], doc.index_from)
            return
        total += doc.keys
        yield doc


def _read_progress(work: Path) -> tuple[int, int]:
    path = work / PROGRESS_FILE
    if not path.is_file():
        return 0, 0
    progress = json.loads(path.read_text(encoding="utf-8"))
    return int(progress["documents"]), int(progress["rows"])


def embed_documents(target, documents: list[TokenDocument], work: Path, config: DenseBuildConfig) -> int:
    """Append hidden states and values of the documents not done yet; return the total rows."""
    done, rows = _read_progress(work)
    hidden_size = target.hidden_size
    # Drop whatever a crash wrote after the last recorded batch.
    for name, row_bytes in ((HIDDEN_FILE, hidden_size * 2), (VALUES_FILE, config.next_tokens * 4)):
        with open(work / name, "ab") as handle:
            handle.truncate(rows * row_bytes)
    total = sum(d.keys for d in documents)
    bar = tqdm(total=total, initial=rows, unit="key", desc="hidden states", dynamic_ncols=True)
    with open(work / HIDDEN_FILE, "ab") as hidden_out, open(work / VALUES_FILE, "ab") as values_out:
        for end, batch_docs in _document_batches(documents, done, config):
            keys, values = _embed_batch(target, batch_docs, config)
            hidden_out.write(keys.astype(np.float16).tobytes())
            values_out.write(values.astype(np.int32).tobytes())
            for handle in (hidden_out, values_out):
                handle.flush()
                os.fsync(handle.fileno())
            rows += keys.shape[0]
            write_json_atomic(work / PROGRESS_FILE, {"documents": end, "rows": rows})
            bar.update(keys.shape[0])
    bar.close()
    return rows


def _document_batches(documents: list[TokenDocument], done: int, config: DenseBuildConfig):
    """Groups of whole documents (from ``done`` on) of about ``batch_tokens`` tokens, with the index after each."""
    batch: list[TokenDocument] = []
    tokens = 0
    for i in range(done, len(documents)):
        doc_tokens = len(documents[i].ids)
        if batch and tokens + doc_tokens > config.batch_tokens:
            yield i, batch
            batch, tokens = [], 0
        batch.append(documents[i])
        tokens += doc_tokens
    if batch:
        yield len(documents), batch


def _windows(doc: TokenDocument, window: int) -> list[tuple[int, int, int]]:
    """``(start, first_key, stop)`` token ranges: the model reads ``ids[start:stop]`` and keys are taken at
    positions ``first_key .. stop - 1`` that have a next token. Each window starts up to half a window before its
    first key, so every key sees at least that much of its preceding text."""
    n = len(doc.ids)
    out = []
    first = doc.index_from
    while first < n - 1:
        start = max(0, first - window // 2)
        stop = min(n, start + window)
        out.append((start, first, stop))
        first = stop
    return out


def _embed_batch(target, documents: list[TokenDocument], config: DenseBuildConfig) -> tuple[np.ndarray, np.ndarray]:
    """Hidden states (``[keys, hidden]`` float32) and next-token values (``[keys, N]``) of whole documents."""
    pieces = [(doc, w) for doc in documents for w in _windows(doc, config.window)]
    keys, values = [], []
    for group in _group_windows(pieces, config.batch_tokens):
        width = max(stop - start for _, (start, _, stop) in group)
        input_ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, (doc, (start, _, stop)) in enumerate(group):
            input_ids[row, : stop - start] = torch.from_numpy(doc.ids[start:stop].astype(np.int64))
            mask[row, : stop - start] = 1
        states = target.hidden_states(input_ids, mask).to("cpu", torch.float32).numpy()
        for row, (doc, (start, first, stop)) in enumerate(group):
            last = min(stop, len(doc.ids) - 1)  # the final token has no next token
            keys.append(states[row, first - start : last - start])
            values.append(next_tokens(doc.ids, np.arange(first, last), config.next_tokens))
    return np.concatenate(keys), np.concatenate(values)


def _group_windows(pieces: list, batch_tokens: int) -> Iterator[list]:
    group, width = [], 0
    for piece in pieces:
        size = piece[1][2] - piece[1][0]
        if group and max(width, size) * (len(group) + 1) > batch_tokens:
            yield group
            group, width = [], 0
        group.append(piece)
        width = max(width, size)
    if group:
        yield group


def next_tokens(ids: np.ndarray, positions: np.ndarray, n: int) -> np.ndarray:
    """``[len(positions), n]`` tokens after each position, padded with ``-1`` past the document's end."""
    offsets = positions[:, None] + 1 + np.arange(n)[None, :]
    out = np.full(offsets.shape, PAD, dtype=np.int64)
    inside = offsets < len(ids)
    out[inside] = np.asarray(ids, dtype=np.int64)[offsets[inside]]
    return out


def _index_keys(hidden: np.ndarray, normaliser: KeyNormaliser, sample_rows: np.ndarray, config: DenseBuildConfig):
    train = normaliser.keys(np.asarray(hidden[sample_rows], dtype=np.float32))
    index = make_index(config.index, config.pca_dim, train, config)
    chunk = 65_536
    with tqdm(total=hidden.shape[0], unit="key", desc=f"{config.index} index", dynamic_ncols=True) as bar:
        for start in range(0, hidden.shape[0], chunk):
            block = normaliser.keys(np.asarray(hidden[start : start + chunk], dtype=np.float32))
            index.add(block)
            bar.update(block.shape[0])
    return index


def _finish(target, work: Path, index, normaliser: KeyNormaliser, explained: np.ndarray, rows: int,
            config: DenseBuildConfig, sources: list[str], seconds: float) -> dict:
    import faiss

    faiss.write_index(index, str(work / INDEX_FILE))
    values = np.memmap(work / VALUES_FILE, dtype=np.int32, mode="r", shape=(rows, config.next_tokens))
    arrays = {
        "mean": write_array(work, "mean.f32", normaliser.mean),
        "std": write_array(work, "std.f32", normaliser.std),
        "components": write_array(work, "components.f32", normaliser.components),
        "values": {"file": VALUES_FILE, "dtype": values.dtype.str, "shape": list(values.shape)},
    }
    header = new_header(
        KIND, target.name, target.tokenizer_fingerprint,
        model={"name": target.name, "fingerprint": target.model_fingerprint, "hidden_size": target.hidden_size},
        vocab_size=target.vocab_size,
        keys=rows, pca_dim=config.pca_dim, next_tokens=config.next_tokens,
        explained_variance=round(float(explained.sum()), 4),
        index={"type": config.index, "file": INDEX_FILE, "bytes": (work / INDEX_FILE).stat().st_size},
        arrays=arrays, sources=sources, build={**asdict(config), "seconds": round(seconds, 1)},
    )
    write_header(work, header)
    return header


def open_dense_store(directory: str | Path, target=None) -> DenseStore:
    """:meth:`DenseStore.open` as a function, for symmetry with the other store kinds."""
    return DenseStore.open(directory, target)
