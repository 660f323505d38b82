"""Suffix store build → open → query round trip, and clear errors for broken or foreign stores."""

import json

import numpy as np
import pytest

from hierspec.datastore.corpus import iter_documents, iter_json_array
from hierspec.datastore.format import DatastoreError, token_dtype
from hierspec.datastore.suffix import SuffixBuildConfig, SuffixStore, build_suffix_store
from hierspec.loading import tokenizer_fingerprint
from tiny import make_tokenizer

DOCS = ["w1 w2 w3 w4", "w1 w2 w3 w5", "w9 w1 w2 w6", "w7 w8"]


@pytest.fixture()
def tokenizer():
    return make_tokenizer(16)


@pytest.fixture()
def store_dir(tmp_path, tokenizer):
    out = tmp_path / "store"
    build_suffix_store(DOCS, tokenizer, "tiny", tokenizer_fingerprint(tokenizer), out,
                       SuffixBuildConfig(batch_size=2, shard_tokens=10))
    return out


def test_round_trip_across_shards(store_dir, tokenizer):
    header = json.loads((store_dir / "header.json").read_text())
    assert header["magic"] == "hierspec-datastore" and header["format_version"] == 1 and header["kind"] == "suffix"
    assert header["token_dtype"] == "uint16" and header["num_documents"] == 4
    assert header["num_tokens"] == 4 + 4 + 4 + 2 + 4  # tokens plus one separator per document
    assert len(header["shards"]) == 2  # shard_tokens=10: two 5-token docs fill the first shard
    store = SuffixStore.open(store_dir, fingerprint=tokenizer_fingerprint(tokenizer))
    assert isinstance(store.shards[0][0], np.memmap)
    match = store.longest_match(np.array([0, 1, 2]), n_max=4, n_min=1)
    assert match.length == 2 and match.count == 3
    rows = sorted(map(tuple, store.continuations(match, k=100, m=2).tolist()))
    assert rows == [(3, 4), (3, 5), (6, -1)]
    info = store.info()
    assert info["bytes_on_disk"] > 0 and info["bytes_per_token"] > 0


def test_token_dtype_never_truncates():
    assert token_dtype(49152) == np.uint16
    assert token_dtype(65535) == np.uint32  # 65535 itself is the uint16 separator
    assert token_dtype(151_936) == np.uint32


def test_truncated_array_is_refused(store_dir):
    path = store_dir / "shard-000.sa"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(DatastoreError, match="truncated or corrupt"):
        SuffixStore.open(store_dir)


def test_wrong_magic_and_newer_version_are_refused(store_dir):
    header_path = store_dir / "header.json"
    header = json.loads(header_path.read_text())
    header_path.write_text(json.dumps({**header, "format_version": 99}))
    with pytest.raises(DatastoreError, match="format version 99.*upgrade hierspec"):
        SuffixStore.open(store_dir)
    header_path.write_text(json.dumps({**header, "magic": "something-else"}))
    with pytest.raises(DatastoreError, match="wrong magic"):
        SuffixStore.open(store_dir)
    header_path.write_text("{not json")
    with pytest.raises(DatastoreError, match="corrupt"):
        SuffixStore.open(store_dir)


def test_mismatched_tokenizer_names_the_builder(store_dir):
    other = tokenizer_fingerprint(make_tokenizer(20))
    with pytest.raises(DatastoreError, match="built with tokenizer 'tiny'"):
        SuffixStore.open(store_dir, fingerprint=other, tokenizer_name="other-model")


def test_missing_store_and_unfinished_build(tmp_path):
    with pytest.raises(DatastoreError, match="not found"):
        SuffixStore.open(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(DatastoreError, match="no header.json"):
        SuffixStore.open(tmp_path / "half")


def test_interrupted_build_leaves_nothing(tmp_path, tokenizer):
    def documents():
        yield "w1 w2"
        raise KeyboardInterrupt

    out = tmp_path / "store"
    with pytest.raises(KeyboardInterrupt):
        build_suffix_store(documents(), tokenizer, "tiny", "fp", out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_existing_store_is_not_overwritten_by_default(store_dir, tokenizer):
    with pytest.raises(DatastoreError, match="already exists"):
        build_suffix_store(DOCS, tokenizer, "tiny", "fp", store_dir)


def test_sharegpt_truncated_file_keeps_complete_records(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "second answer"}]},
    ]
    text = json.dumps(records)
    truncated = text[:-1] + ', {"id": "c", "conversations": [{"from": "gpt", "value": "cut he'
    path = tmp_path / "sharegpt.json"
    path.write_text(truncated)
    assert [r["id"] for r in iter_json_array(path)] == ["a", "b"]
    assert list(iter_documents(path)) == ["hello there", "second answer"]


def test_jsonl_text_and_messages(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([
        json.dumps({"text": "plain text"}),
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
    ]) + "\n")
    assert list(iter_documents(path)) == ["plain text", "a"]
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(Exception, match="bad.jsonl:1"):
        list(iter_documents(tmp_path / "bad.jsonl"))


def test_code_directory(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    return 1\n")
    (tmp_path / "pkg" / "b.bin").write_bytes(b"\x00\xff")
    (tmp_path / "pkg" / "site-packages" / "dep").mkdir(parents=True)
    (tmp_path / "pkg" / "site-packages" / "dep" / "c.py").write_text("x = 1\n")
    assert list(iter_documents(tmp_path / "pkg")) == ["def f():\n    return 1\n"]
