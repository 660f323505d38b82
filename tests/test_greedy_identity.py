"""Speculative greedy decoding must reproduce plain greedy decoding token for token."""

from collections import Counter

import numpy as np
import pytest
import torch

from drafters_for_tests import ScriptedDrafter
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter, PromptLookupConfig, PromptLookupDrafter
from tiny import ARCHITECTURES, make_target

VOCAB = 64


@pytest.fixture(scope="module", params=ARCHITECTURES)
def target(request):
    return make_target(request.param, vocab_size=VOCAB, seed=3)


def _prompts(count, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(rng.integers(1, 30))).tolist() for _ in range(count)]


def test_plain_path_equals_transformers_generate(target):
    config = GenerationConfig(max_new_tokens=24)
    plain = SpeculativeDecoder(target, NoDrafter())
    for prompt in _prompts(6, seed=1):
        ours = plain.generate(prompt, config).token_ids
        with torch.inference_mode():
            out = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                        eos_token_id=0, pad_token_id=0, attention_mask=torch.ones(1, len(prompt)))
        assert ours == out[0, len(prompt):].tolist()


def test_scripted_trees_reproduce_plain_decoding(target):
    config = GenerationConfig(max_new_tokens=40, max_draft_tokens=24)
    plain = SpeculativeDecoder(target, NoDrafter())
    saw_partial_acceptance = saw_full_rejection = saw_multi = False
    for i, prompt in enumerate(_prompts(12, seed=2)):
        reference = plain.generate(prompt, config)
        drafter = ScriptedDrafter(len(prompt), reference.token_ids, VOCAB, seed=i)
        result = SpeculativeDecoder(target, drafter).generate(prompt, config)
        assert result.token_ids == reference.token_ids
        assert result.finish_reason == reference.finish_reason
        lengths = result.stats.accept_lengths
        saw_multi |= max(lengths) > 1
        saw_full_rejection |= min(lengths) == 1
        saw_partial_acceptance |= any(1 < n < 9 for n in lengths)
        assert sum(lengths) == len(result.token_ids)
        assert result.stats.target_forwards < reference.stats.target_forwards or len(reference.token_ids) <= 1
    assert saw_multi and saw_full_rejection and saw_partial_acceptance


def test_prompt_lookup_reproduces_plain_decoding(target):
    config = GenerationConfig(max_new_tokens=48)
    plain = SpeculativeDecoder(target, NoDrafter())
    pld = SpeculativeDecoder(target, PromptLookupDrafter(PromptLookupConfig(max_ngram=3, min_ngram=1)))
    rng = np.random.default_rng(5)
    for _ in range(8):
        motif = rng.integers(1, VOCAB, size=6).tolist()
        prompt = motif * 3 + rng.integers(1, VOCAB, size=4).tolist() + motif[:2]
        assert pld.generate(prompt, config).token_ids == plain.generate(prompt, config).token_ids


def test_never_emits_more_than_asked_and_stops_at_eos(target):
    plain = SpeculativeDecoder(target, NoDrafter())
    for prompt in _prompts(6, seed=9):
        reference = plain.generate(prompt, GenerationConfig(max_new_tokens=30))
        drafter = ScriptedDrafter(len(prompt), reference.token_ids, VOCAB, seed=0)
        for limit in (1, 2, 7):
            result = SpeculativeDecoder(target, drafter).generate(prompt, GenerationConfig(max_new_tokens=limit))
            assert result.token_ids == reference.token_ids[:limit]
        if 0 in reference.token_ids:
            assert reference.token_ids[-1] == 0 and reference.finish_reason == "eos"
        else:
            assert len(reference.token_ids) == 30 and reference.finish_reason == "length"


def test_generation_stops_at_the_context_limit():
    target = make_target("llama", vocab_size=VOCAB, seed=4, max_positions=40)
    result = SpeculativeDecoder(target, NoDrafter()).generate(list(range(1, 31)),
                                                             GenerationConfig(max_new_tokens=100, stop_at_eos=False))
    assert len(result.token_ids) == 10 and result.finish_reason == "length"


def test_rest_reproduces_plain_decoding(target, tmp_path):
    from hierspec.datastore.suffix import SuffixStore, build_suffix_store
    from hierspec.drafters.rest import RestConfig, RestDrafter

    config = GenerationConfig(max_new_tokens=40)
    plain = SpeculativeDecoder(target, NoDrafter())
    prompts = _prompts(8, seed=21)
    references = [plain.generate(p, config).token_ids for p in prompts]
    # A corpus holding half of the reference outputs (so drafts are often right) and noise.
    rng = np.random.default_rng(0)
    corpus = [" ".join(f"w{t}" for t in ref) for ref in references[::2]]
    corpus += [" ".join(f"w{t}" for t in rng.integers(1, VOCAB, size=30)) for _ in range(20)]
    out = tmp_path / "store"
    build_suffix_store(corpus, target.tokenizer, "tiny", target.tokenizer_fingerprint, out)
    store = SuffixStore.open(out, fingerprint=target.tokenizer_fingerprint)
    rest = SpeculativeDecoder(target, RestDrafter(store, RestConfig(c=16)))
    forwards = 0
    for prompt, reference in zip(prompts, references):
        result = rest.generate(prompt, config)
        assert result.token_ids == reference
        forwards += result.stats.target_forwards
    assert forwards < sum(len(r) for r in references)


def test_hierarchy_drafting_reproduces_plain_decoding(target, tmp_path):
    from hierspec.datastore.model_store import ModelStoreConfig
    from hierspec.store_builds import build_model_store
    from hierspec.datastore.ngram import NgramTable
    from hierspec.datastore.recent_outputs import RecentOutputs
    from hierspec.datastore.suffix import SuffixStore, build_suffix_store
    from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter, ModelDatabase, StatisticsDatabase

    config = GenerationConfig(max_new_tokens=40)
    plain = SpeculativeDecoder(target, NoDrafter())
    prompts = _prompts(8, seed=31)
    references = [plain.generate(p, config).token_ids for p in prompts]
    # D_m: the model's answers to half of the prompts (as the builder makes it); D_s: noise plus other references
    texts = [" ".join(f"w{t}" for t in p) for p in prompts[::2]]
    build_model_store(target, texts, tmp_path / "model",
                      ModelStoreConfig(key_len=2, value_len=4, max_new_tokens=40, method="ar"))
    rng = np.random.default_rng(1)
    corpus = [" ".join(f"w{t}" for t in ref) for ref in references[1::4]]
    corpus += [" ".join(f"w{t}" for t in rng.integers(1, VOCAB, size=30)) for _ in range(20)]
    build_suffix_store(corpus, target.tokenizer, "tiny", target.tokenizer_fingerprint, tmp_path / "suffix")
    model = ModelDatabase(NgramTable.open(tmp_path / "model", target.tokenizer_fingerprint), min_count=1)
    statistics = StatisticsDatabase(SuffixStore.open(tmp_path / "suffix"), value_len=5, n_min=2)
    # o: earlier outputs of the process — a third of the references, then every generation as it finishes
    outputs = RecentOutputs(max_tokens=400)
    for reference in references[::3]:
        outputs.add(reference)
    forwards_by_order = {}
    for order, tree, credit in (("cms", "fixed", "best"), ("smc", "fixed", "best"), ("c", "fixed", "best"),
                                ("m", "fixed", "best"), ("cms", "scored", "best"), ("m", "scored", "best"),
                                ("ao", "scored", "best"), ("acmso", "scored", "best"), ("acmso", "scored", "shared"),
                                ("aocms", "fixed", "best")):
        drafter = HierarchyDrafter(HierarchyConfig(l=2, m=5, n=3, order=order, recycle_topk=2, lead="cmsao", tree=tree,
                                                   credit=credit), model, statistics, outputs=outputs)
        decoder = SpeculativeDecoder(target, drafter)
        forwards = 0
        accepted = Counter()
        for prompt, reference in zip(prompts, references):
            result = decoder.generate(prompt, config)
            assert result.token_ids == reference
            forwards += result.stats.target_forwards
            accepted.update(result.stats.accepted_by_source)
        forwards_by_order[order, tree, credit] = forwards
        if order == "ao":  # both suffix-match sources drafted accepted tokens (outputs: the earlier references)
            assert accepted["automaton"] > 0 and accepted["outputs"] > 0, accepted
    for key in (("cms", "fixed"), ("m", "fixed"), ("cms", "scored"), ("m", "scored"), ("ao", "scored"),
                ("acmso", "scored")):
        for credit in ("best", "shared") if key == ("acmso", "scored") else ("best",):
            assert forwards_by_order[(*key, credit)] < sum(len(r) for r in references), (key, credit)
