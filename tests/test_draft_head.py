"""Draft heads: the store (training, format, refusals), the ``h`` source of hd and lossless decoding with it."""

import json

import numpy as np
import pytest
import torch

from hierspec.config import GenerationConfig
from hierspec.datastore.dense import TokenDocument
from hierspec.datastore.draft_head import (HeadBuildConfig, HeadStore, build_head_store, frequent_tokens,
                                           probability_bin, shortlist_distribution, top_probabilities,
                                           train_head,
                                           training_pairs)
from hierspec.datastore.format import DatastoreError
from hierspec.datastore.successors import SuccessorTable
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.head_source import HeadDatabase
from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter
from hierspec.errors import InputError
from tiny import make_target

VOCAB = 64
#: a shortlist that is not a whole number of the int4 kernels' 16-row tiles
CONFIG = HeadBuildConfig(shortlist=45, width=64, epochs=2, batch=64, lr=3e-3, held_out=0.1, window=64,
                         batch_tokens=512)


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, seed=7)


@pytest.fixture(scope="module")
def documents(target):
    """The target's greedy continuations of random prompts (what decoding will verify against)."""
    rng = np.random.default_rng(0)
    plain = SpeculativeDecoder(target, NoDrafter())
    docs = []
    for _ in range(40):
        prompt = rng.integers(1, VOCAB, size=6).tolist()
        out = plain.generate(prompt, GenerationConfig(max_new_tokens=40, stop_at_eos=False)).token_ids
        docs.append(TokenDocument(np.array(prompt + out)))
    return docs


@pytest.fixture(scope="module")
def store(target, documents, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "head"
    build_head_store(target, documents, out, CONFIG, sources=["test"])
    return HeadStore.open(out, target)


# ----------------------------------------------------------------------------------------------- pieces
def test_training_pairs_stay_inside_documents():
    assert training_pairs([3, 2]).tolist() == [0, 1, 3]
    assert training_pairs([1, 4, 1]).tolist() == [1, 2, 3]
    assert training_pairs([1]).tolist() == []


def test_frequent_tokens_by_count_then_id():
    assert frequent_tokens(np.array([3, 1, 3, 2, 1, 3]), 2).tolist() == [3, 1]
    assert frequent_tokens(np.array([5, 4, 4, 5]), 3).tolist() == [4, 5]


def test_top_probabilities_are_the_softmax_of_the_largest():
    top, probabilities = top_probabilities(np.log(np.array([1.0, 3.0, 2.0, 2.0])), 2)
    assert top[0] == 1 and top[1] in (2, 3)
    np.testing.assert_allclose(probabilities, [0.375, 0.25])
    assert top_probabilities(np.log(np.array([4.0, 1.0, 1.0, 2.0])), 1)[0].tolist() == [0]
    assert top_probabilities(np.zeros(3), 5)[0].shape == (3,)


def test_probability_bins():
    assert [probability_bin(p) for p in (0.9, 0.5, 0.3, 0.25, 0.1, 0.09, 0.0)] == [0, 0, 1, 1, 2, 3, 3]


def test_config_rejects_bad_values():
    with pytest.raises(InputError):
        HeadBuildConfig(shortlist=0)
    with pytest.raises(InputError):
        HeadBuildConfig(held_out=0.0)


# ----------------------------------------------------------------------------------------------- the store
def test_training_learns_a_function_of_the_hidden_state_and_the_root():
    """Labels that depend on both inputs (the hidden state's largest of four dimensions, shifted by the root's id):
    the trained head predicts them on held-out pairs far above the most frequent label's share."""
    rng = np.random.default_rng(0)
    rows, dim, vocab = 6000, 16, 32
    hidden = rng.normal(size=(rows, dim)).astype(np.float16)
    values = rng.integers(0, vocab, size=rows).astype(np.int32)
    labels = np.zeros(rows, dtype=np.int64)
    labels[1:] = (values[:-1] + 8 * np.argmax(hidden[:-1, :4], axis=1)) % vocab
    embeddings = torch.from_numpy(rng.normal(size=(vocab, dim)).astype(np.float32))
    outputs = torch.from_numpy(rng.normal(size=(vocab, dim)).astype(np.float32))
    config = HeadBuildConfig(shortlist=vocab, width=128, epochs=12, batch=64, lr=3e-3, held_out=0.1, distill=False)
    head, shortlist, accuracy = train_head(hidden, values, labels, np.arange(rows - 1), embeddings, outputs, config)
    baseline = np.bincount(labels[1:]).max() / (rows - 1)
    assert sorted(shortlist.tolist()) == list(range(vocab))
    assert baseline < 0.1 and accuracy["top1"] >= 0.6 and accuracy["top4"] >= accuracy["top1"]
    assert sum(b["share"] for b in accuracy["by_confidence"]) == pytest.approx(1.0, abs=1e-3)


def test_shortlist_distribution_is_the_softmax_over_the_shortlist_rows():
    rows = torch.tensor([[0.0, 1.0], [np.log(3.0), 0.0]])
    got = shortlist_distribution(torch.tensor([[1.0, 0.0], [0.0, np.log(2.0)]]), rows)
    torch.testing.assert_close(got, torch.tensor([[0.25, 0.75], [2 / 3, 1 / 3]], dtype=got.dtype))


def test_distillation_learns_the_targets_next_distribution():
    """A sequence whose next hidden state is the output row of a token fixed by the current state and token (with
    noise): the target's prediction there (the argmax of that state's logits, as a build labels it) is learnt from
    the next states' distributions alone; the top-1 labels only select the shortlist and score the held-out pairs."""
    rng = np.random.default_rng(1)
    rows, dim, vocab = 6000, 16, 32
    outputs = torch.from_numpy(rng.normal(size=(vocab, dim)).astype(np.float32))
    embeddings = torch.from_numpy(rng.normal(size=(vocab, dim)).astype(np.float32))
    values = rng.integers(0, vocab, size=rows).astype(np.int32)
    states = np.zeros((rows, dim), dtype=np.float32)
    states[0] = rng.normal(size=dim)
    for r in range(rows - 1):
        token = (values[r] + 8 * int(np.argmax(states[r, :4]))) % vocab
        states[r + 1] = outputs[token].numpy() + 0.3 * rng.normal(size=dim)
    hidden = states.astype(np.float16)
    labels = (torch.from_numpy(hidden.astype(np.float32)) @ outputs.T).argmax(-1).numpy()
    config = HeadBuildConfig(shortlist=vocab, width=128, epochs=12, batch=64, lr=3e-3, held_out=0.1)
    assert config.distill
    _, _, accuracy = train_head(hidden, values, labels, np.arange(rows - 1), embeddings, outputs, config)
    baseline = np.bincount(labels[1:]).max() / (rows - 1)
    assert baseline < 0.15 and accuracy["top1"] >= 0.6


def test_built_store_reports_its_accuracy_and_guesses_from_its_shortlist(target, store):
    accuracy = store.header["accuracy"]
    assert accuracy["held_out_pairs"] > 50 and 0.0 <= accuracy["top1"] <= accuracy["top4"] <= 1.0
    assert store.header["model"]["fingerprint"] == target.model_fingerprint
    hidden = target.hidden_states(torch.tensor([[4, 9, 17, 3]]))[0].to(torch.float32).numpy()
    tokens, probabilities = store.guess(hidden[2], target.input_embeddings()[3], 3)
    assert tokens.shape == (3,) and np.all(np.diff(probabilities) <= 1e-7) and 0 < probabilities.sum() <= 1 + 1e-6
    assert set(tokens.tolist()) <= set(store.shortlist.tolist())
    again = HeadStore.open(store.directory, target).guess(hidden[2], target.input_embeddings()[3], 3)
    assert np.array_equal(again[0], tokens)


def test_store_refuses_another_models_head(store):
    other = make_target("llama", vocab_size=VOCAB, seed=8)
    with pytest.raises(DatastoreError, match="model-specific"):
        HeadStore.open(store.directory, other)


def test_store_refuses_truncated_or_non_finite_arrays(store, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(store.directory, copy)
    weights = copy / "up.weight.f32"
    weights.write_bytes(weights.read_bytes()[:-4])
    with pytest.raises(DatastoreError):
        HeadStore.open(copy)
    shutil.rmtree(copy)
    shutil.copytree(store.directory, copy)
    gain = np.fromfile(copy / "gain.f32", dtype="<f4")
    gain[0] = np.nan
    gain.tofile(copy / "gain.f32")
    with pytest.raises(DatastoreError, match="not finite"):
        HeadStore.open(copy)
    header = json.loads((copy / "header.json").read_text())
    header["arrays"]["shortlist"]["shape"] = [3]
    (copy / "header.json").write_text(json.dumps(header))
    with pytest.raises(DatastoreError):
        HeadStore.open(copy)


def test_build_refuses_documents_too_short(target, tmp_path):
    with pytest.raises(InputError):
        build_head_store(target, [TokenDocument(np.array([1]))], tmp_path / "h", CONFIG)


# ----------------------------------------------------------------------------------------------- the source
def test_source_is_empty_without_a_hidden_state(target, store):
    source = HeadDatabase(store, target.input_embeddings(), depth=4, width=2)
    assert source.retrieve_scored(np.array([1, 2, 3]), 6) == []


def test_source_continues_each_guess_with_its_successor_chain(target, store):
    successors = SuccessorTable(VOCAB, 2)
    hidden = target.hidden_states(torch.tensor([[4, 9, 17]]))[0, -2].to(torch.float32).numpy()
    tokens, probabilities = store.guess(hidden, target.input_embeddings()[17], 2)
    first = int(tokens[0])
    successors.update(np.array([first, 30]), np.array([[30, 31], [32, 33]]))
    source = HeadDatabase(store, target.input_embeddings(), depth=3, width=2, successors=successors)
    source.set_query(hidden)
    found = source.retrieve_scored(np.array([4, 9, 17]), 6)
    assert found[0] == ((first, 30, 32), probability_bin(float(probabilities[0])))
    assert found[1][0][0] == int(tokens[1]) and len(found) == 2
    source.reset()
    assert source.retrieve_scored(np.array([4, 9, 17]), 6) == []


@pytest.mark.parametrize("tree", ["scored", "fixed"])
def test_hd_with_a_head_is_identical_to_plain_decoding(target, store, tree):
    rng = np.random.default_rng(5)
    plain = SpeculativeDecoder(target, NoDrafter())
    drafter = HierarchyDrafter(HierarchyConfig(l=1, m=4, order="hct", lead="hc", tree=tree), head=store,
                               embeddings=target.input_embeddings(), successors=SuccessorTable(VOCAB, 4))
    assert drafter.wants_hidden and "head" in drafter.sources
    speculative = SpeculativeDecoder(target, drafter)
    drafted = 0
    for _ in range(4):
        prompt = rng.integers(1, VOCAB, size=7).tolist()
        config = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
        expected = plain.generate(prompt, config).token_ids
        result = speculative.generate(prompt, config)
        assert result.token_ids == expected
        drafted += result.stats.drafted_by_source.get("head", 0)
    assert drafted > 0


# ----------------------------------------------------------------------------------------------- int4 kernels
def test_q8_0_rounding_of_a_float_weight():
    from hierspec.runtime.quantized import as_int8, quantize_q8_0

    weight = torch.randn(32, 96) * torch.logspace(-3, 1, 32)[:, None]
    passes = quantize_q8_0(weight)
    assert len(passes) == 2
    rebuilt = passes[0].dequantize() + passes[1].dequantize()
    step = weight.reshape(32, 3, 32).abs().amax(-1).repeat_interleave(32, dim=1) / 127
    assert torch.all((rebuilt - weight).abs() <= step / 2 + 1e-6)
    codes, _ = as_int8(passes)
    assert int(codes.abs().max()) == 127  # each group's largest weight is its scale's 127
    assert torch.equal(quantize_q8_0(torch.zeros(16, 32))[1].dequantize(), torch.zeros(16, 32))


def test_head_on_the_int4_kernels_guesses_as_in_float32(target, store):
    from hierspec.runtime.quantized import resolve_kernel

    kernels, reason = resolve_kernel("auto")
    if kernels is None:
        pytest.skip(f"no int4 kernel here: {reason}")
    assert store.shortlist.shape[0] % 16  # the padded path
    quantized = HeadStore.open(store.directory, target)
    quantized.use_kernels(kernels)
    embeddings = target.input_embeddings()
    rng = np.random.default_rng(2)
    same = 0
    for _ in range(40):
        ids = rng.integers(1, VOCAB, size=8).tolist()
        hidden = target.hidden_states(torch.tensor([ids]))[0, -2].to(torch.float32).numpy()
        exact, p_exact = store.guess(hidden, embeddings[ids[-1]], 3)
        rounded, p_rounded = quantized.guess(hidden, embeddings[ids[-1]], 3)
        assert set(rounded.tolist()) <= set(store.shortlist.tolist())
        same += int(exact[0] == rounded[0])
        assert abs(float(p_exact[0]) - float(p_rounded[0])) < 0.05
    assert same >= 36
    quantized.use_kernels(None)
    assert np.array_equal(quantized.guess(hidden, embeddings[ids[-1]], 3)[0], exact)


def test_the_compiled_guess_is_the_numpy_steps_guess_on_the_same_kernels_and_rows_do_not_affect_each_other(
        target, store):
    from hierspec.runtime import int4_kernel
    from hierspec.runtime.quantized import resolve_kernel

    kernels, reason = resolve_kernel("auto")
    if kernels is None or int4_kernel.loaded_kernel() is None:
        pytest.skip(f"no compiled int4 extension here: {reason}")
    quantized = HeadStore.open(store.directory, target)
    quantized.use_kernels(kernels)
    compiled = quantized._compiled
    assert compiled is not None
    embeddings = target.input_embeddings()
    rng = np.random.default_rng(5)
    ids = [rng.integers(1, VOCAB, size=8).tolist() for _ in range(12)]
    hidden = np.stack([target.hidden_states(torch.tensor([row]))[0, -2].to(torch.float32).numpy() for row in ids])
    roots = torch.stack([embeddings[row[-1]] for row in ids])
    together, p_together = compiled(hidden, roots, 4)
    assert together.shape == p_together.shape == (12, 4)
    for i in range(12):
        tokens, probabilities = quantized.guess(hidden[i], roots[i], 4)  # one row through the compiled call
        alone, p_alone = compiled(hidden[i], roots[i], 4)
        assert np.array_equal(alone[0], together[i]) and np.array_equal(p_alone[0], p_together[i])
        assert np.array_equal(tokens, store.shortlist[together[i]])
        quantized._compiled = None  # the same products, the steps between them in NumPy
        numpy_tokens, numpy_probabilities = quantized.guess(hidden[i], roots[i], 4)
        quantized._compiled = compiled
        assert np.array_equal(tokens, numpy_tokens)
        np.testing.assert_allclose(probabilities, numpy_probabilities, rtol=1e-5, atol=1e-7)
        assert np.all(np.diff(probabilities) <= 0) and probabilities.sum() <= 1 + 1e-6


def test_hd_stops_asking_a_head_whose_guesses_the_tree_never_takes(target, store, monkeypatch):
    """With a cost curve on which no node pays, the head is asked at steps 1, 3, 7, 15, 23, ... (the wait doubling
    up to h_gate = 8); with one on which every node pays, at every step."""
    calls = []
    real = HeadStore.guess

    def counted(self, *args):
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(HeadStore, "guess", counted)
    prompt = [4, 9, 17, 3, 22, 8]
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    for cost, every_step in ((lambda rows: float(rows) ** 3, False), (lambda rows: 1.0, True)):
        calls.clear()
        drafter = HierarchyDrafter(HierarchyConfig(l=1, m=3, order="ht", explore_every=0, h_gate=8), head=store,
                                   embeddings=target.input_embeddings(), successors=SuccessorTable(VOCAB, 4),
                                   cost=cost)
        result = SpeculativeDecoder(target, drafter).generate(prompt, config)
        steps = result.stats.target_forwards
        if every_step:
            assert len(calls) == steps  # every step's tree took a guess: asked every time
            assert result.stats.drafted_by_source.get("head", 0) >= steps
        else:
            assert steps == 30 and len(calls) == 5  # steps 1, 3, 7, 15, 23
