"""Speculative sampling is lossless: the joint law of the first three tokens equals the target's exact law.

The exact law is computed from uncached forwards of the model over every prefix; the decoder runs 10 000 times
with fixed seeds — sixteen generations at a time through the batch scheduler, one setting one at a time — and
adversarial draft trees (most likely, least likely and random tokens, with branching). A χ²
goodness-of-fit test (cells with expected count < 5 pooled) must not reject at p = 0.001, and tokens the warped
distribution excludes (top-k / top-p) must never appear.
"""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from drafters_for_tests import AdversarialDrafter
from hierspec.accept import warp_probs
from hierspec.batching import BatchConfig, BatchScheduler
from hierspec.config import GenerationConfig, SamplingConfig
from hierspec.decode import SpeculativeDecoder
from tiny import make_target

VOCAB = 8
PROMPT = [3]
#: seeded runs per χ² test: the power test below shows this many detect a temperature of 0.72 instead of 0.7 (and 0.8
#: instead of 1); measured over 50 seeds of the biased counts, 10 000 runs rejected every time (8 000: every time,
#: 6 000: 64 %), the exact law never
RUNS = 10_000
#: generations sampled together (continuous batching) by the χ² tests; the plain-decoding loop keeps one test
BATCH = 16
CHUNK = 1000
SETTINGS = {
    "temperature-1": SamplingConfig(temperature=1.0),
    "temperature-0.7-top-p-0.9": SamplingConfig(temperature=0.7, top_p=0.9),
    "top-k-3": SamplingConfig(temperature=1.0, top_k=3),
}


def exact_table(target, sampling):
    """Warped next-token distribution after every generated prefix of length 0, 1 and 2."""
    table = {}
    for length in range(3):
        for prefix in itertools.product(range(VOCAB), repeat=length):
            with torch.inference_mode():
                logits = target.model(input_ids=torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            table[prefix] = warp_probs(logits, sampling).numpy()
    return table


def exact_joint(table):
    joint = np.zeros((VOCAB,) * 3)
    for a, b, c in itertools.product(range(VOCAB), repeat=3):
        joint[a, b, c] = table[()][a] * table[(a,)][b] * table[(a, b)][c]
    return joint


def chi_square_pvalue(observed, expected_probs, runs):
    expected = expected_probs * runs
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, seed=12, layers=1, hidden=16, init_std=0.2)


def sample_counts(target, drafter_factory, sampling, runs=RUNS, batch: int | None = BATCH):
    """Counts of the first three tokens over ``runs`` seeded generations, and the mean target forwards per run.

    ``batch`` generations run together (continuous batching, each with its own drafter from ``drafter_factory``:
    each exactly as it runs alone, ``tests/test_batching.py``) — about 3x faster on the tiny models; ``None``: one
    after another through one :class:`SpeculativeDecoder`."""
    configs = [GenerationConfig(max_new_tokens=3, stop_at_eos=False, sampling=SamplingConfig(
        sampling.temperature, sampling.top_p, sampling.top_k, seed=run)) for run in range(runs)]
    if batch is None:
        decoder = SpeculativeDecoder(target, drafter_factory())
        results = [decoder.generate(PROMPT, config) for config in configs]
    else:
        results = []
        for start in range(0, runs, CHUNK):  # a scheduler per chunk: requests are not all held at once
            scheduler = BatchScheduler(target, drafter_factory, BatchConfig(max_batch=batch))
            requests = [scheduler.submit(PROMPT, config) for config in configs[start : start + CHUNK]]
            scheduler.run()
            results.extend(request.result for request in requests)
    counts = np.zeros((VOCAB,) * 3)
    for result in results:
        counts[tuple(result.token_ids)] += 1
    return counts, sum(result.stats.target_forwards for result in results) / runs


@pytest.mark.parametrize("name", list(SETTINGS))
def test_tree_sampling_matches_exact_distribution(target, name):
    sampling = SETTINGS[name]
    table = exact_table(target, sampling)
    joint = exact_joint(table)
    # one setting through the one-at-a-time loop, the others batched
    counts, forwards_per_run = sample_counts(
        target, lambda: AdversarialDrafter(len(PROMPT), table.get, VOCAB, seed=7), sampling,
        batch=None if name == "temperature-1" else BATCH)
    assert counts.sum() == RUNS
    assert counts[joint == 0].sum() == 0, "a token outside the warped support was emitted"
    assert forwards_per_run < 3.0, "the drafts were never accepted: the test would not exercise acceptance"
    pvalue = chi_square_pvalue(counts, joint, RUNS)
    assert pvalue > 1e-3, f"{name}: p = {pvalue:.2e}"


def test_chi_square_detects_a_biased_sampler(target):
    """The statistic has power: counts drawn from a slightly different law are rejected (temperature 0.8 vs 1, and
    0.72 vs 0.7 with top-p 0.9, the draft-model tests' setting)."""
    for exact, shifted in ((SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8)),
                           (SETTINGS["temperature-0.7-top-p-0.9"], SamplingConfig(temperature=0.72, top_p=0.9))):
        biased = exact_joint(exact_table(target, shifted))
        counts = np.random.default_rng(0).multinomial(RUNS, biased.ravel()).reshape(biased.shape).astype(float)
        assert chi_square_pvalue(counts, exact_joint(exact_table(target, exact)), RUNS) < 1e-3


class _FixedDatabase:
    """A model-store stand-in proposing fixed sequences (likely and unlikely ones alike)."""

    def retrieve(self, context, limit):
        return [[1, 2, 3], [5, 5], [0, 7, 1]][:limit]


def test_hierarchy_drafting_sampling_matches_exact_distribution(target):
    """Scored trees over the context database, a model database, the successor table, the context's suffix
    automaton and earlier outputs (which every run adds to)."""
    from hierspec.datastore.recent_outputs import RecentOutputs
    from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter
    from hierspec.datastore.successors import SuccessorTable

    outputs = RecentOutputs(max_tokens=200)
    outputs.add([1, 2, 3, 1, 2, 5, 5, 0, 7])

    sampling = SETTINGS["temperature-0.7-top-p-0.9"]
    joint = exact_joint(exact_table(target, sampling))
    counts, forwards_per_run = sample_counts(
        target,
        lambda: HierarchyDrafter(HierarchyConfig(l=1, m=3, candidates=4, order="cmtao", recycle_topk=2,
                                                 tree="scored", o_min_match=1),
                                 _FixedDatabase(), successors=SuccessorTable(VOCAB, 4), outputs=outputs),
        sampling,
    )
    assert counts[joint == 0].sum() == 0
    assert forwards_per_run < 3.0
    pvalue = chi_square_pvalue(counts, joint, RUNS)
    assert pvalue > 1e-3, f"hd: p = {pvalue:.2e}"



def test_dense_retrieval_sampling_matches_exact_distribution(target, tmp_path):
    from hierspec.datastore.dense import DenseBuildConfig, DenseStore, TokenDocument, build_dense_store
    from hierspec.drafters.dense import DenseConfig, DenseDrafter

    rng = np.random.default_rng(3)
    documents = [TokenDocument(np.array(PROMPT + rng.integers(0, VOCAB, size=12).tolist())) for _ in range(40)]
    build_dense_store(target, documents, tmp_path / "dense", DenseBuildConfig(pca_dim=8, next_tokens=4, index="flat"))
    store = DenseStore.open(tmp_path / "dense", target)
    sampling = SETTINGS["temperature-0.7-top-p-0.9"]
    joint = exact_joint(exact_table(target, sampling))
    config = DenseConfig(k=16, sampled_num_drafts=4, sampled_draft_len=3, min_score=-1.0)
    counts, forwards_per_run = sample_counts(target, lambda: DenseDrafter(store, config), sampling)
    assert counts[joint == 0].sum() == 0
    assert forwards_per_run < 3.0
    pvalue = chi_square_pvalue(counts, joint, RUNS)
    assert pvalue > 1e-3, f"dense: p = {pvalue:.2e}"


def test_hierarchy_drafting_with_a_draft_head_sampling_matches_exact_distribution(target, tmp_path):
    """hd whose head guesses (continued by the successor table) are drafted beside the context database."""
    from hierspec.datastore.dense import TokenDocument
    from hierspec.datastore.draft_head import HeadBuildConfig, HeadStore, build_head_store
    from hierspec.datastore.successors import SuccessorTable
    from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter

    rng = np.random.default_rng(4)
    documents = [TokenDocument(np.array(PROMPT + rng.integers(0, VOCAB, size=12).tolist())) for _ in range(40)]
    build_head_store(target, documents, tmp_path / "head", HeadBuildConfig(shortlist=VOCAB, width=16, epochs=2,
                                                                            held_out=0.1))
    store = HeadStore.open(tmp_path / "head", target)
    sampling = SETTINGS["temperature-0.7-top-p-0.9"]
    joint = exact_joint(exact_table(target, sampling))

    def drafter():  # the fixed tree drafts the head's two guesses whenever it has a hidden state
        return HierarchyDrafter(HierarchyConfig(l=1, m=3, n=3, order="htc", lead="h", h_width=2, tree="fixed"),
                                head=store, embeddings=target.input_embeddings(), successors=SuccessorTable(VOCAB, 4))

    one = SpeculativeDecoder(target, drafter()).generate(PROMPT, GenerationConfig(
        max_new_tokens=3, stop_at_eos=False, sampling=SamplingConfig(sampling.temperature, sampling.top_p, seed=0)))
    assert one.stats.drafted_by_source.get("head", 0) > 0
    counts, forwards_per_run = sample_counts(target, drafter, sampling)
    assert counts[joint == 0].sum() == 0
    assert forwards_per_run < 3.0
    pvalue = chi_square_pvalue(counts, joint, RUNS)
    assert pvalue > 1e-3, f"hd with a head: p = {pvalue:.2e}"
