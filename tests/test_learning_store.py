"""The model store that keeps learning, and the successor table: persisted in versions, bounded, safe against a
writer killed mid-write, refused to another tokenizer, and drafting losslessly."""

import multiprocessing
import os

import numpy as np
import pytest

from hierspec.config import GenerationConfig
from hierspec.datastore import learning as learning_module
from hierspec.datastore.format import DatastoreError
from hierspec.datastore.learning import LearningStore
from hierspec.datastore.ngram import NgramTable
from hierspec.datastore.output import build_lock
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter
from hierspec.datastore.successors import SuccessorTable
from hierspec.methods import DrafterContext, make_drafter
from tiny import make_target

VOCAB = 64


def _open(directory, max_grams=1000, fingerprint="f" * 32):
    return LearningStore.open(directory, "tiny", fingerprint, VOCAB, key_len=1, value_len=2, max_grams=max_grams,
                              successor_k=3)


def test_successor_table_example():
    table = SuccessorTable(VOCAB, k=2)
    table.update(np.array([5, 6, 7, 9]), np.array([[6, 9], [7, 2], [5, 1], [1, 3]]))
    assert table.chains(5, depth=3, width=2) == [([6, 7, 5], 0), ([9, 1], 1)]  # nothing known after 1
    assert table.chains(4, depth=3, width=2) == []  # nothing known after token 4
    table.update(np.array([5]), np.array([[8]]))  # a narrower top-k forgets the old runners-up
    assert table.table[5].tolist() == [8, -1]


def test_generations_are_learned_persisted_and_bounded(tmp_path):
    store = _open(tmp_path / "model")
    assert len(store.table) == 0 and store.version == 1
    store.add_generation(np.array([1, 2, 3, 4, 2, 3, 4]))  # grams 123 234 342 423 (234 twice: counted once)
    store.add_generation(np.array([9, 2, 3, 4]))  # 923 234
    store.successors.update(np.array([2]), np.array([[3, 5, 7]]))
    assert store.flush() and store.version == 2 and store.pending == 0
    again = _open(tmp_path / "model")
    grams, counts = again.table.grams_and_counts()
    learned = {tuple(g): int(c) for g, c in zip(grams.tolist(), counts.tolist())}
    assert learned == {(1, 2, 3): 1, (2, 3, 4): 2, (3, 4, 2): 1, (4, 2, 3): 1, (9, 2, 3): 1}
    assert [v.tolist() for v in again.table.lookup(np.array([2]), 3)] == [[3, 4]]
    assert again.successors.table[2].tolist() == [3, 5, 7]
    assert NgramTable.open(tmp_path / "model").header["learning"]["generations"] == 2

    small = _open(tmp_path / "small", max_grams=3)
    for doc in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4], [7, 8, 9, 1, 2, 3]):
        small.add_generation(np.array(doc))
        small.flush()
    assert len(small.table) == 3  # the most frequent grams only
    grams, counts = small.table.grams_and_counts()
    assert {tuple(g) for g in grams.tolist()} >= {(1, 2, 3)} and counts.max() == 3
    versioned = sorted(p.name for p in (tmp_path / "small").iterdir() if p.name.startswith("ngrams"))
    assert len(versioned) == 4  # this version's and the previous one's files, no more


def test_another_tokenizer_is_refused(tmp_path):
    _open(tmp_path / "model")
    with pytest.raises(DatastoreError, match="built with tokenizer"):
        _open(tmp_path / "model", fingerprint="e" * 32)


def _flush_and_die(directory):
    store = _open(directory)
    store.add_generation(np.array([5, 6, 7, 8]))
    learning_module.write_header = lambda *args: os._exit(17)  # arrays written, header not yet replaced
    store.flush()


def test_a_writer_killed_mid_write_leaves_the_previous_version_readable(tmp_path):
    store = _open(tmp_path / "model")
    store.add_generation(np.array([1, 2, 3, 4]))
    store.flush()
    before = {tuple(g) for g in store.table.grams_and_counts()[0].tolist()}
    child = multiprocessing.get_context("fork").Process(target=_flush_and_die, args=(tmp_path / "model",))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 17
    survivor = _open(tmp_path / "model")
    assert survivor.version == 2 and {tuple(g) for g in survivor.table.grams_and_counts()[0].tolist()} == before
    survivor.add_generation(np.array([5, 6, 7, 8]))
    assert survivor.flush() and survivor.version == 3  # the orphaned files of the dead writer are harmless


def test_a_flush_waits_for_another_writer(tmp_path):
    store = _open(tmp_path / "model")
    store.add_generation(np.array([1, 2, 3, 4]))
    with build_lock((tmp_path / "model").resolve()):
        assert not store.flush()
    assert store.pending == 1 and store.flush() and store.pending == 0


def test_hd_learning_across_generations_stays_lossless_and_drafts_from_what_it_learned(tmp_path):
    target = make_target("llama", vocab_size=VOCAB, seed=3)
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    prompt = [4, 9, 4, 17, 30]
    reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config).token_ids
    context = DrafterContext(target, store_root=str(tmp_path))
    drafter = make_drafter("hd:learn=true,flush_every=1,order=mt", context)
    decoder = SpeculativeDecoder(target, drafter)
    first = decoder.generate(prompt, config)
    assert first.token_ids == reference
    second = decoder.generate(prompt, config)  # the store now holds the first answer; successors are warm
    assert second.token_ids == reference
    assert second.stats.accepted_by_source.get("model", 0) + second.stats.accepted_by_source.get("successors", 0) > 0
    assert second.stats.target_forwards < first.stats.target_forwards
    stored = list((tmp_path).rglob("header.json"))
    assert len(stored) == 1 and NgramTable.open(stored[0].parent).header["learning"]["generations"] == 2


def test_the_successor_source_alone_is_lossless_and_learns_within_a_run():
    target = make_target("qwen2", vocab_size=VOCAB, seed=4)
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    drafter = HierarchyDrafter(HierarchyConfig(order="t"), successors=SuccessorTable(VOCAB, 4))
    assert drafter.verifier_topk == 4
    decoder = SpeculativeDecoder(target, drafter)
    for prompt in ([1, 2, 3], [5, 6, 7, 5, 6], [1, 2, 3]):
        reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config).token_ids
        assert decoder.generate(prompt, config).token_ids == reference
    assert drafter.successors.updates > 0


def test_serve_learns_into_a_model_store_only_when_there_is_one(tmp_path):
    from hierspec.cli import server_learning
    from hierspec.methods import MethodSpec

    target = make_target("llama", vocab_size=VOCAB, seed=3)
    without = DrafterContext(target, store_root=str(tmp_path))
    assert server_learning(MethodSpec.parse("hd"), without, True) == MethodSpec.parse("hd")  # nothing to learn into
    store = tmp_path / "given-model"
    LearningStore.open(store, target.name, target.tokenizer_fingerprint, VOCAB)
    given = DrafterContext(target, (str(store),), store_root=str(tmp_path))
    assert dict(server_learning(MethodSpec.parse("hd"), given, True).options)["learn"] == "true"
    assert server_learning(MethodSpec.parse("hd"), given, False) == MethodSpec.parse("hd")  # --no-learn
    assert server_learning(MethodSpec.parse("hd:learn=false"), given, True) == MethodSpec.parse("hd:learn=false")
    assert server_learning(MethodSpec.parse("pld"), given, True) == MethodSpec.parse("pld")
