"""Opening corrupted stores: any header value of any type, any file name, any bytes in the arrays — opening gives a
store or a DatastoreError, and a store that opens answers queries without crashing (property-based, hypothesis)."""

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hierspec.datastore.dense import DenseBuildConfig, DenseStore, TokenDocument, build_dense_store
from hierspec.datastore.format import DatastoreError
from hierspec.datastore.ngram import NgramTable, write_ngram_table
from hierspec.datastore.suffix import SuffixStore, build_suffix_store
from hierspec.loading import tokenizer_fingerprint
from tiny import make_target, make_tokenizer

VOCAB = 64
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=12)
    | st.sampled_from(["../../etc/passwd", "/etc/passwd", "..", "", "<u2", "<i4", "<f4", "|b1"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    tokenizer = make_tokenizer(VOCAB)
    fingerprint = tokenizer_fingerprint(tokenizer)
    rng = np.random.default_rng(0)
    docs = [" ".join(f"w{t}" for t in rng.integers(1, VOCAB, size=30)) for _ in range(20)]
    build_suffix_store(docs, tokenizer, "tiny", fingerprint, root / "suffix")
    grams = rng.integers(0, VOCAB, size=(50, 5))
    write_ngram_table(root / "model", grams, rng.integers(1, 9, size=50), 1, VOCAB, "tiny", fingerprint)
    target = make_target("llama", vocab_size=VOCAB, seed=1)
    build_dense_store(target, [TokenDocument(rng.integers(0, VOCAB, size=40)) for _ in range(5)], root / "dense",
                      DenseBuildConfig(pca_dim=8, next_tokens=4, index="flat"))
    return root


def _copy(stores: Path, kind: str) -> Path:
    directory = Path(tempfile.mkdtemp(dir=stores.parent)) / kind  # inside pytest's temporary root
    shutil.copytree(stores / kind, directory)
    return directory


def _set(header: dict, path: tuple, value) -> None:
    node = header
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _edit(directory: Path, path: tuple, value) -> None:
    header = json.loads((directory / "header.json").read_text())
    _set(header, path, value)
    (directory / "header.json").write_text(json.dumps(header))


def _query_suffix(store: SuffixStore) -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        match = store.longest_match(rng.integers(0, VOCAB, size=6), 6, 1)
        if match is not None:
            rows = store.continuations(match, 8, 4)
            assert rows.dtype == np.int64 and rows.min(initial=-1) >= -1 and rows.max(initial=0) < store.vocab_size


def _query_model(table: NgramTable) -> None:
    for key in range(VOCAB):
        for row in table.lookup(np.array([key]), 4):
            assert row.min(initial=0) >= 0 and row.max(initial=0) < VOCAB


def _query_dense(store: DenseStore) -> None:
    scores, rows = store.search(np.random.default_rng(0).standard_normal(store.normaliser.mean.shape[0]), 4)
    assert rows.shape == scores.shape


HEADER_FIELDS = {
    "suffix": [("magic",), ("format_version",), ("kind",), ("tokenizer",), ("vocab_size",), ("separator",),
               ("num_tokens",), ("shards",), ("shards", 0), ("shards", 0, "tokens"), ("shards", 0, "tokens", "file"),
               ("shards", 0, "tokens", "dtype"), ("shards", 0, "tokens", "shape"),
               ("shards", 0, "suffix_array", "file"), ("shards", 0, "suffix_array", "dtype")],
    "model": [("format_version",), ("key_len",), ("value_len",), ("vocab_size",), ("arrays",), ("arrays", "tokens"),
              ("arrays", "tokens", "file"), ("arrays", "tokens", "dtype"), ("arrays", "tokens", "shape"),
              ("arrays", "counts", "shape")],
    "dense": [("format_version",), ("arrays",), ("arrays", "mean"), ("arrays", "mean", "file"),
              ("arrays", "components", "shape"), ("arrays", "values", "dtype"), ("arrays", "values", "shape"),
              ("index",), ("index", "file"), ("index", "bytes"), ("model",)],
}
OPEN_AND_QUERY = {"suffix": (SuffixStore.open, _query_suffix), "model": (NgramTable.open, _query_model),
                  "dense": (DenseStore.open, _query_dense)}


@pytest.mark.parametrize("kind", list(HEADER_FIELDS))
@FUZZ
@given(data=st.data())
def test_header_fuzz(stores, kind, data):
    """Any value at any header field: the store opens and answers queries, or it is one DatastoreError."""
    directory = _copy(stores, kind)
    _edit(directory, data.draw(st.sampled_from(HEADER_FIELDS[kind])), data.draw(json_values))
    open_store, query = OPEN_AND_QUERY[kind]
    try:
        store = open_store(directory)
    except DatastoreError:
        return
    query(store)


@FUZZ
@given(name=st.sampled_from(["shard-000.tokens", "shard-000.sa"]), seed=st.integers(0, 2**32 - 1),
       fraction=st.sampled_from([0.01, 0.3, 1.0]))
def test_suffix_store_array_bytes_fuzz(stores, name, seed, fraction):
    directory = _copy(stores, "suffix")
    data = bytearray((directory / name).read_bytes())
    rng = np.random.default_rng(seed)
    where = rng.random(len(data)) < fraction
    data = bytes(np.where(where, rng.integers(0, 256, size=len(data)), np.frombuffer(bytes(data), np.uint8))
                 .astype(np.uint8))
    (directory / name).write_bytes(data)
    try:
        store = SuffixStore.open(directory)  # sizes and header are intact: it opens unless a value is out of range
    except DatastoreError as exc:
        assert "the store is damaged" in str(exc)
        return
    _query_suffix(store)
    try:
        store.verify()
    except DatastoreError:
        pass


@FUZZ
@given(seed=st.integers(0, 2**32 - 1))
def test_model_store_array_bytes_fuzz(stores, seed):
    directory = _copy(stores, "model")
    rng = np.random.default_rng(seed)
    size = (directory / "ngrams.tokens").stat().st_size
    (directory / "ngrams.tokens").write_bytes(rng.integers(0, 256, size=size, dtype=np.uint8).tobytes())
    try:
        table = NgramTable.open(directory)
    except DatastoreError:
        return
    _query_model(table)
