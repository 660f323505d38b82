"""Dense retrieval (DReSD): normalisation, the store and its builder, and lossless decoding with dense drafts."""

import json

import numpy as np
import pytest
import torch

import hierspec.datastore.dense as dense_module
from hierspec.config import GenerationConfig, SamplingConfig
from hierspec.datastore.dense import (
    DenseBuildConfig,
    DenseStore,
    TokenDocument,
    build_dense_store,
    fit_normaliser,
    next_tokens,
)
from hierspec.datastore.format import DatastoreError
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import Drafter, NoDrafter
from hierspec.drafters.dense import DenseConfig, DenseDrafter, DenseRetriever
from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter
from hierspec.errors import InputError
from hierspec.tree import chain
from tiny import make_target

VOCAB = 64


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, seed=7)


def _own_outputs(target, count, length, seed):
    """The target's greedy continuations of random prompts: in-distribution data for its dense store."""
    rng = np.random.default_rng(seed)
    plain = SpeculativeDecoder(target, NoDrafter())
    docs, prompts = [], []
    for _ in range(count):
        prompt = rng.integers(1, VOCAB, size=6).tolist()
        out = plain.generate(prompt, GenerationConfig(max_new_tokens=length, stop_at_eos=False)).token_ids
        docs.append(TokenDocument(np.array(prompt + out), index_from=len(prompt) - 1))
        prompts.append(prompt)
    return docs, prompts


@pytest.fixture(scope="module")
def corpus(target):
    return _own_outputs(target, count=24, length=40, seed=0)


@pytest.fixture(scope="module")
def flat_store(target, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("dense") / "flat"
    # one window per document: every key sees its whole document, as a query in decoding does
    build_dense_store(target, corpus[0], out, DenseBuildConfig(pca_dim=16, next_tokens=8, index="flat",
                                                              window=64, batch_tokens=256))
    return DenseStore.open(out, target)


# ----------------------------------------------------------------------------------------------- normalisation
def test_pca_round_trip_on_vectors_in_a_subspace():
    rng = np.random.default_rng(0)
    basis = rng.normal(size=(5, 16))
    vectors = (rng.normal(size=(400, 5)) * [9, 5, 3, 2, 1]) @ basis + rng.normal(size=16) * 4
    normaliser, explained = fit_normaliser(vectors, pca_dim=5)
    assert np.allclose(normaliser.reconstruct(normaliser.reduce(vectors)), vectors, atol=1e-3)
    assert explained.sum() == pytest.approx(1.0, abs=1e-4) and np.all(np.diff(explained) <= 1e-9)
    assert np.allclose(normaliser.components.T @ normaliser.components, np.eye(5), atol=1e-4)
    keys = normaliser.keys(vectors)
    assert keys.dtype == np.float32 and np.allclose(np.linalg.norm(keys, axis=1), 1.0, atol=1e-5)
    again, _ = fit_normaliser(vectors, pca_dim=5)
    assert np.allclose(again.keys(vectors), keys)  # signs are fixed: refitting gives the same keys


def test_z_normalisation_centres_and_scales():
    rng = np.random.default_rng(1)
    vectors = rng.normal(loc=[100, -3, 0.5], scale=[10, 0.1, 2], size=(2000, 3))
    normaliser, _ = fit_normaliser(vectors, pca_dim=3)
    z = (vectors - normaliser.mean) / normaliser.std
    assert np.allclose(z.mean(axis=0), 0, atol=1e-4) and np.allclose(z.std(axis=0), 1, atol=1e-3)


def test_bad_pca_dim_and_build_settings_are_refused():
    with pytest.raises(InputError, match="pca_dim"):
        fit_normaliser(np.ones((10, 4)), pca_dim=5)
    with pytest.raises(InputError, match="index type"):
        DenseBuildConfig(index="annoy")
    with pytest.raises(InputError, match="needs k"):
        DenseConfig(k=0)


def test_next_tokens_pad_past_the_end():
    ids = np.array([5, 6, 7, 8])
    assert next_tokens(ids, np.array([0, 2]), 3).tolist() == [[6, 7, 8], [8, -1, -1]]


# ----------------------------------------------------------------------------------------------- the store
def _hidden_at(target, ids):
    return target.hidden_states(torch.tensor([ids]))[0].float().numpy()


def test_identical_keys_retrieve_their_own_values(target, corpus, flat_store):
    docs, _ = corpus
    checked = 0
    for doc in docs[:6]:
        states = _hidden_at(target, doc.ids.tolist())
        for t in range(doc.index_from + 1, len(doc.ids) - 1, 5):
            scores, rows = flat_store.search(states[t], 1)
            assert scores[0] > 0.999
            assert flat_store.values[rows[0]].tolist() == next_tokens(doc.ids, np.array([t]), 8)[0].tolist()
            checked += 1
    assert checked >= 30 and flat_store.size == sum(d.keys for d in docs)


@pytest.mark.parametrize("index", ["hnsw", "ivf"])
def test_approximate_indexes_find_identical_keys(target, corpus, tmp_path, index):
    docs, _ = corpus
    out = tmp_path / index
    build_dense_store(target, docs, out, DenseBuildConfig(pca_dim=16, next_tokens=4, index=index, window=64))
    store = DenseStore.open(out, target)
    retriever = DenseRetriever(store, DenseConfig(k=4, nprobe=8))
    found = total = 0
    for doc in docs[:8]:
        states = _hidden_at(target, doc.ids.tolist())
        for t in range(doc.index_from, len(doc.ids) - 1, 3):
            _, rows = store.search(states[t], 1)
            found += store.values[rows[0]].tolist() == next_tokens(doc.ids, np.array([t]), 4)[0].tolist()
            total += 1
    assert found >= 0.9 * total
    assert store.header["index"]["type"] == index and retriever.config.nprobe == 8


def test_retriever_keeps_neighbours_that_start_with_the_root(target, corpus, flat_store):
    docs, _ = corpus
    doc = docs[0]
    t = doc.index_from + 3
    retriever = DenseRetriever(flat_store, DenseConfig(k=8))
    retriever.set_query(_hidden_at(target, doc.ids.tolist())[t])
    sequences = retriever.sequences(int(doc.ids[t + 1]), limit=3, length=5)
    assert sequences and sequences[0].tolist() == doc.ids[t + 2 : t + 7].tolist()
    assert retriever.sequences(int(doc.ids[t + 1]), 3, 5) == []  # a query answers one step
    retriever.set_query(_hidden_at(target, doc.ids.tolist())[t])
    wrong_root = (int(doc.ids[t + 1]) + 1) % VOCAB
    assert all(int(s[0]) != -1 for s in retriever.sequences(wrong_root, 3, 5))
    assert retriever.report()["dense_queries"] == 2
    strict = DenseRetriever(flat_store, DenseConfig(k=8, min_score=1.0))  # nothing is that similar to a new state
    strict.set_query(_hidden_at(target, [1, 2, 3])[-1])
    assert strict.sequences(int(doc.ids[t + 1]), 3, 5) == []


# ----------------------------------------------------------------------------------------------- builder
def test_builder_resumes_after_an_interruption(target, corpus, tmp_path, monkeypatch):
    docs, _ = corpus
    config = DenseBuildConfig(pca_dim=8, next_tokens=6, index="flat", window=32, batch_tokens=64)
    reference = tmp_path / "reference"
    build_dense_store(target, docs, reference, config)

    real_embed = dense_module._embed_batch
    calls = {"n": 0}

    def failing_embed(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_embed(*args, **kwargs)

    out = tmp_path / "resumed"
    monkeypatch.setattr(dense_module, "_embed_batch", failing_embed)
    with pytest.raises(KeyboardInterrupt):
        build_dense_store(target, docs, out, config)
    partial = tmp_path / ".resumed.partial"
    assert not out.exists() and json.loads((partial / "progress.json").read_text())["rows"] > 0
    with pytest.raises(DatastoreError, match="other inputs or settings"):
        build_dense_store(target, docs[:-1], out, config)

    calls["n"] = -1000  # no more failures; count the batches the resumed build embeds
    build_dense_store(target, docs, out, config)
    assert 0 < calls["n"] + 1000 < len(list(dense_module._document_batches(docs, 0, config)))
    assert not partial.exists()
    a, b = DenseStore.open(reference, target), DenseStore.open(out, target)
    assert np.array_equal(np.asarray(a.values), np.asarray(b.values)) and b.index.ntotal == a.index.ntotal
    assert np.allclose(a.normaliser.components, b.normaliser.components, atol=1e-4)


def test_wrong_model_and_corrupt_stores_are_refused(target, corpus, flat_store, tmp_path):
    other = make_target("llama", vocab_size=VOCAB, seed=8)
    with pytest.raises(DatastoreError, match="model-specific"):
        DenseStore.open(flat_store.directory, other)
    with pytest.raises(DatastoreError, match="tokenizer"):
        DenseStore.open(flat_store.directory, make_target("llama", vocab_size=VOCAB + 8, seed=7))
    assert make_target("llama", vocab_size=VOCAB, seed=7, dtype=torch.float32).model_fingerprint == \
        target.model_fingerprint  # the same weights in another dtype are the same model

    out = tmp_path / "broken"
    build_dense_store(target, corpus[0][:3], out, DenseBuildConfig(pca_dim=4, next_tokens=4, index="flat"))
    with open(out / "values.i32", "r+b") as handle:
        handle.truncate(12)
    with pytest.raises(DatastoreError, match="truncated or corrupt"):
        DenseStore.open(out, target)
    (out / "keys.faiss").unlink()
    with pytest.raises(DatastoreError):
        DenseStore.open(out, target)
    with pytest.raises(DatastoreError, match="already exists"):
        build_dense_store(target, corpus[0][:3], out, DenseBuildConfig(pca_dim=4, next_tokens=4, index="flat"))
    with pytest.raises(InputError, match="hidden size"):
        build_dense_store(target, corpus[0][:3], tmp_path / "x", DenseBuildConfig(pca_dim=999, index="flat"))


# ----------------------------------------------------------------------------------------------- decoding
class _HiddenRecorder(Drafter):
    """Checks each hidden state handed over: after the prefill it is the state at the prompt's second-to-last
    token; after a verification it is the state whose (greedy) prediction is the context's last token."""

    wants_hidden = True

    def __init__(self, target, prompt, reference):
        self.target, self.prompt, self.reference, self.hidden, self.checked = target, prompt, reference, None, 0

    def observe_hidden(self, hidden):
        self.hidden = hidden

    def propose(self, context, budget):
        assert self.hidden is not None
        if len(context) == len(self.prompt):
            expected = _hidden_at(self.target, self.prompt)[-2]
            assert np.allclose(self.hidden, expected, atol=1e-5)
        else:
            with torch.no_grad():
                logits = self.target.model.lm_head(torch.from_numpy(self.hidden).to(self.target.dtype))
            assert int(logits.argmax()) == int(context[-1])
        self.checked += 1
        self.hidden = None
        right = self.reference[len(context) : len(context) + 2]  # two right tokens, then a wrong one
        return chain(int(context[-1]), [*right, (right[-1] + 1) % VOCAB] if right else [], ["test"] * (len(right) + 1)
                     if right else [])


def test_hidden_state_handed_to_drafters_predicts_the_root(target):
    prompt = [3, 9, 4, 1]
    config = GenerationConfig(max_new_tokens=15, stop_at_eos=False)
    reference = prompt + SpeculativeDecoder(target, NoDrafter()).generate(prompt, config).token_ids
    recorder = _HiddenRecorder(target, prompt, reference)
    result = SpeculativeDecoder(target, recorder).generate(prompt, config)
    assert result.token_ids == reference[len(prompt):] and max(result.stats.accept_lengths) == 3
    assert recorder.checked == result.stats.target_forwards  # every step had its state


def test_dense_greedy_output_is_identical_and_uses_drafts(target, corpus, flat_store):
    _, prompts = corpus
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    plain = SpeculativeDecoder(target, NoDrafter())
    dense = SpeculativeDecoder(target, DenseDrafter(flat_store, DenseConfig(num_drafts=2, draft_len=6, min_score=-1.0)))
    accepted = 0
    for prompt in prompts[:6] + [[5, 17, 30, 2, 9, 11, 40]]:
        reference = plain.generate(prompt, config)
        result = dense.generate(prompt, config)
        assert result.token_ids == reference.token_ids
        accepted += result.stats.accepted_drafts
        assert result.stats.drafter["dense_queries"] > 0
    assert accepted > 0


def test_hd_with_a_dense_source_is_identical(target, corpus, flat_store):
    _, prompts = corpus
    config = GenerationConfig(max_new_tokens=32, stop_at_eos=False)
    retriever = DenseRetriever(flat_store, DenseConfig(k=16, min_score=-1.0))
    hd = HierarchyDrafter(HierarchyConfig(order="cd", lead="cd", m=4, tree="fixed"), dense=retriever)
    assert hd.wants_hidden and hd.sources == ["context", "dense"]
    decoder = SpeculativeDecoder(target, hd)
    dense_accepted = 0
    for prompt in prompts[6:10]:
        reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config)
        result = decoder.generate(prompt, config)
        assert result.token_ids == reference.token_ids
        dense_accepted += result.stats.accepted_by_source.get("dense", 0)
    assert dense_accepted > 0


def test_draft_shape_follows_greedy_or_sampling(target, corpus, flat_store):
    _, prompts = corpus
    drafter = DenseDrafter(flat_store, DenseConfig(sampled_num_drafts=4, sampled_draft_len=3))
    drafter.prepare(SamplingConfig(temperature=0.8), torch.Generator())
    assert drafter._shape == (4, 3)
    drafter.prepare(SamplingConfig(), torch.Generator())
    assert drafter._shape == (3, 10)


def test_a_store_with_values_outside_the_vocabulary_is_refused_when_opened_for_generation(target, flat_store,
                                                                                           tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(flat_store.directory, damaged)
    values_file = damaged / dense_module.VALUES_FILE
    values = np.fromfile(values_file, dtype="<i4")
    values[5] = VOCAB + 3
    values.tofile(values_file)
    DenseStore.open(damaged)  # sizes and header intact: info opens it, --verify finds it
    with pytest.raises(DatastoreError, match="outside the vocabulary"):
        DenseStore.open(damaged, target)
