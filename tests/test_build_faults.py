"""A datastore build killed at any point leaves the old store (or the new one) and every unrelated file intact;
concurrent builds into one directory are refused; a directory that appears during a build is not replaced."""

import multiprocessing
import os
from pathlib import Path

import pytest

from hierspec.datastore import output, suffix
from hierspec.datastore.format import DatastoreError
from hierspec.datastore.output import build_lock, exchange_directories
from hierspec.datastore.suffix import SuffixStore, build_suffix_store
from hierspec.loading import tokenizer_fingerprint
from tiny import make_tokenizer

OLD = ["w1 w2 w3 w4", "w5 w6 w7"]
NEW = ["w9 w8 w7 w6 w5 w4 w3 w2 w1", "w10 w11 w12", "w13 w14"]


def _build(documents, out, overwrite=False):
    tokenizer = make_tokenizer(64)
    return build_suffix_store(documents, tokenizer, "tiny", tokenizer_fingerprint(tokenizer), out, overwrite=overwrite)


def _die():
    os._exit(17)


def _documents_then_die(documents, after):
    for i, doc in enumerate(documents):
        if i == after:
            _die()
        yield doc


def _child(out: str, point: str) -> None:
    """Rebuild ``out`` with ``--overwrite`` and die at ``point``."""
    documents = NEW
    if point == "tokenizing":
        documents = _documents_then_die(NEW, after=1)
    elif point == "suffix-array":
        suffix.suffix_array = lambda tokens: _die()
    elif point == "header":
        suffix.write_header = lambda directory, header: _die()
    elif point == "before-swap":
        output.exchange_directories = lambda a, b: _die()
    elif point == "after-swap":
        def swap_then_die(a, b):
            exchange_directories(a, b)
            _die()
        output.exchange_directories = swap_then_die
    _build(documents, Path(out), overwrite=True)


def _snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("point", ["tokenizing", "suffix-array", "header", "before-swap", "after-swap"])
def test_a_killed_rebuild_loses_nothing(tmp_path, point):
    out = tmp_path / "store"
    _build(OLD, out)
    old = _snapshot(out)
    (tmp_path / "notes.txt").write_text("unrelated")
    (tmp_path / "other-dir").mkdir()
    (tmp_path / "other-dir" / "data.bin").write_bytes(b"\x00\x01")
    unrelated = {k: v for k, v in _snapshot(tmp_path).items() if not k.startswith("store")}

    child = multiprocessing.get_context("fork").Process(target=_child, args=(str(out), point))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 17, f"the build was not killed at {point}"

    after = {k: v for k, v in _snapshot(tmp_path).items() if not k.startswith(("store", ".store"))}
    assert after == unrelated
    store = SuffixStore.open(out)  # the old store, or (killed after the swap) the complete new one
    if point == "after-swap":
        assert store.header["num_documents"] == len(NEW)
    else:
        assert _snapshot(out) == old
    # the next build clears what the dead one left behind and succeeds
    _build(NEW, out, overwrite=True)
    assert SuffixStore.open(out).header["num_documents"] == len(NEW)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "other-dir", "store"]


def test_a_second_build_into_the_same_directory_is_refused_while_the_first_runs(tmp_path):
    out = tmp_path / "store"
    with build_lock(out.resolve()):
        with pytest.raises(DatastoreError, match="another build is writing"):
            _build(OLD, out)
    _build(OLD, out)  # the lock is released with the first build
    assert SuffixStore.open(out).header["num_documents"] == len(OLD)


def test_a_directory_that_appears_during_the_build_is_not_replaced(tmp_path):
    out = tmp_path / "store"

    def documents():
        yield OLD[0]
        out.mkdir()
        (out / "precious.txt").write_text("created meanwhile")
        yield OLD[1]

    with pytest.raises(DatastoreError, match="already exists"):
        _build(documents(), out)
    assert (out / "precious.txt").read_text() == "created meanwhile"
    assert [p.name for p in tmp_path.iterdir()] == ["store"]  # no temporary left behind


def test_stale_temporaries_of_dead_builds_are_removed_by_the_next_build(tmp_path):
    stale = tmp_path / ".store.tmp-12345-abc"
    stale.mkdir()
    (stale / "shard-000.sa").write_bytes(b"\x00" * 1000)
    _build(OLD, tmp_path / "store")
    assert not stale.exists()


def test_exchange_swaps_two_directories_atomically(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    (b / "y").write_text("from b")
    if not exchange_directories(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is unavailable here; the two-rename fallback is used")
    assert (a / "y").read_text() == "from b" and (b / "x").read_text() == "from a"
