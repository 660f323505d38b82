"""Draft models: self-drafting, the draft LM's cache, sd with self-verify, HSDDW — greedy identity and unit rules."""

import numpy as np
import pytest
import torch

from hierspec.accept import Verdict, accept_greedy, accept_speculative
from hierspec.config import GenerationConfig, SamplingConfig
from hierspec.datastore.successors import SuccessorTable
from hierspec.decode import SpeculativeDecoder
from hierspec.draft_lm import CATCH_UP_ROWS, DraftLM, check_same_tokenizer, self_drafting_model, shortlist_tokens
from hierspec.drafters import NoDrafter, PromptLookupConfig, PromptLookupDrafter
from hierspec.drafters.cost_aware import CostAwareDrafter
from hierspec.drafters.deferred_start import RENT, DeferredStart
from hierspec.drafters.draft_model import DraftModelConfig, DraftModelDrafter, EntropyThreshold, entropy
from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter, draft_model_of
from hierspec.drafters.hsddw import HSDDWConfig, HSDDWDrafter
from hierspec.errors import InputError
from hierspec.methods import DrafterContext, make_drafter
from hierspec.drafters.token_window import TokenWindow
from hierspec.tree import chain, root_only
from tiny import ARCHITECTURES, make_target

VOCAB = 64


@pytest.fixture(scope="module", params=ARCHITECTURES)
def target(request):
    return make_target(request.param, vocab_size=VOCAB, seed=3, layers=4)


@pytest.fixture(scope="module")
def small(target):
    """A separate, smaller model with the same vocabulary and tokenizer as the target."""
    arch = "llama" if "llama" in target.name else "qwen2"
    return make_target(arch, vocab_size=VOCAB, seed=11, layers=1, hidden=16)


def _prompts(count, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(rng.integers(1, 20))).tolist() for _ in range(count)]


# ---------------------------------------------------------------- self-drafting and the draft LM


def test_self_drafting_shares_weights_and_leaves_the_target_intact(target):
    draft = self_drafting_model(target, 2)
    assert draft.model.config.num_hidden_layers == 2 and target.model.config.num_hidden_layers == 4
    assert len(draft.model.model.layers) == 2 and len(target.model.model.layers) == 4
    assert draft.model.model.layers[1] is target.model.model.layers[1]
    assert draft.model.lm_head.weight.data_ptr() == target.model.lm_head.weight.data_ptr()
    assert draft.model.model.norm is target.model.model.norm
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.inference_mode():
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states[2]  # after 2 layers
        expected = target.model.lm_head(target.model.model.norm(hidden))
        assert torch.allclose(draft.model(input_ids=ids).logits, expected)
        assert target.model(input_ids=ids).logits.shape == expected.shape  # still the full model


def test_self_drafting_rejects_bad_layer_counts(target):
    for layers in (0, 4, 9):
        with pytest.raises(InputError, match="self-drafting takes 1 to 3"):
            self_drafting_model(target, layers)


def test_a_draft_model_with_another_tokenizer_is_refused(target):
    other = make_target("llama", vocab_size=VOCAB + 2, seed=1, layers=1, hidden=16)
    with pytest.raises(InputError, match="another tokenizer"):
        check_same_tokenizer(other, target)


def test_draft_lm_rolls_back_to_the_accepted_prefix(target):
    lm = DraftLM(target)
    with torch.inference_mode():
        def fresh(ids):
            return target.model(input_ids=torch.tensor([ids])).logits[0, -1]
        context = np.array([4, 8, 15, 16], dtype=np.int64)
        assert torch.allclose(lm.next_logits(context), fresh([4, 8, 15, 16]))
        assert torch.allclose(lm.next_logits(np.append(context, [23, 42])), fresh([4, 8, 15, 16, 23, 42]))
        # the next context diverges after 16: the cache must drop 23, 42
        assert torch.allclose(lm.next_logits(np.append(context, [30])), fresh([4, 8, 15, 16, 30]))
        assert torch.allclose(lm.next_logits(context[:2]), fresh([4, 8]))


def test_draft_lm_reads_the_tokens_it_lacks_in_the_same_forward_as_the_tree(target):
    """After a verification the draft lacks the target's own token: it is read above the root in the scoring
    forward (one forward a step, not two), the logits as a fresh forward gives them; a long gap (a prompt) goes
    through prefill first."""
    lm = DraftLM(target)
    with torch.inference_mode():
        def fresh(ids):
            return target.model(input_ids=torch.tensor([ids])).logits[0, -1]
        context = np.array([4, 8, 15, 16, 23], dtype=np.int64)
        lm.next_logits(context)
        assert lm.forwards == 1  # four tokens to read: above the root, in the same forward
        before = lm.forwards
        tree = chain(7, [9, 11], ["draft", "draft"])
        logits = lm.score_tree(np.append(context, [42, 7]), tree)  # 42 is missing above the root 7
        assert lm.forwards == before + 1 and logits.shape[0] == tree.size
        for node, ids in enumerate(([42, 7], [42, 7, 9], [42, 7, 9, 11])):
            assert torch.allclose(logits[node], fresh([4, 8, 15, 16, 23, *ids]), atol=1e-5)
        lm.keep((1,))  # the root and node 1 (token 9) accepted
        assert lm._tokens == [4, 8, 15, 16, 23, 42, 7, 9]
        assert torch.allclose(lm.next_logits(np.array([4, 8, 15, 16, 23, 42, 7, 9, 5])),
                              fresh([4, 8, 15, 16, 23, 42, 7, 9, 5]), atol=1e-5)
        long_gap = np.concatenate([context, np.arange(1, 1 + CATCH_UP_ROWS + 2)]).astype(np.int64)
        before = lm.forwards
        assert torch.allclose(lm.next_logits(long_gap), fresh(long_gap.tolist()), atol=1e-5)
        assert lm.forwards == before + 2  # prefill of the gap, then the root


# ---------------------------------------------------------------- rules


def test_speculative_sampling_along_a_chain_on_hand_made_distributions():
    """p = [0.2, 0.5, 0.3, 0] after the root, q = [0.1, 0.8, 0.1, 0]: draft token 1 is kept with probability
    p/q = 0.625; on rejection the residual norm(max(p - q, 0)) = [1/3, 0, 2/3, 0] gives the replacement; when kept,
    the bonus is a plain draw from the uniform p after it. With the draft token itself drawn from q, the first
    output token is distributed as p."""
    q = torch.tensor([[0.1, 0.8, 0.1, 0.0]], dtype=torch.float64)
    p_logits = torch.log(torch.tensor([[0.2, 0.5, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64))
    tree = chain(3, [1], ["draft"], q)
    generator = torch.Generator().manual_seed(0)
    runs = 20_000
    first = np.zeros(4)
    replaced = np.zeros(4)
    bonus = np.zeros(4)
    for _ in range(runs):
        verdict = accept_speculative(tree, p_logits, SamplingConfig(temperature=1.0), generator)
        if verdict.path:
            first[1] += 1
            bonus[verdict.bonus] += 1
        else:
            first[verdict.bonus] += 1
            replaced[verdict.bonus] += 1
    assert abs(first[1] / runs - 0.625) < 0.015
    assert replaced[1] == replaced[3] == 0
    assert abs(replaced[2] / replaced.sum() - 2 / 3) < 0.03
    assert np.allclose(bonus / bonus.sum(), 0.25, atol=0.02)
    out = np.zeros(4)
    for _ in range(runs):
        drafted = int(torch.multinomial(q[0], 1, generator=generator))
        verdict = accept_speculative(chain(3, [drafted], ["draft"], q), p_logits, SamplingConfig(temperature=1.0),
                                     generator)
        out[verdict.accepted_tokens[0]] += 1
    assert np.allclose(out / runs, [0.2, 0.5, 0.3, 0.0], atol=0.015)


def test_entropy_threshold_follows_the_rejections():
    threshold = EntropyThreshold(initial=0.7)
    assert threshold.value == 0.7 and threshold.confident(0.7) and not threshold.confident(0.71)
    for h, expected in [(2.0, 2.0), (1.0, 1.5), (0.0, 1.0), (3.0, 1.5)]:
        threshold.record_rejection(h)
        assert threshold.value == pytest.approx(expected)
    threshold.reset()
    assert threshold.value == 0.7
    assert entropy(torch.tensor([0.5, 0.5, 0.0])) == pytest.approx(np.log(2))


class _FixedLM:
    """A stand-in draft LM whose distribution depends only on the number of tokens drafted so far."""

    def __init__(self, rows):
        self.rows, self.forwards, self.model = rows, 0, type("M", (), {"name": "fixed"})()
        self.start = 0

    def reset(self):
        self.forwards = 0

    tokens = None  # a whole head: scores are indexed by token id

    def next_scores(self, context):
        row = self.rows[min(len(context) - self.start, len(self.rows) - 1)]
        return torch.log(torch.tensor(row, dtype=torch.float64))

    def spread(self, scores, fill):
        return scores


def test_self_verify_window_stops_above_the_threshold_and_learns_from_rejections():
    confident, unsure = [0.97, 0.01, 0.01, 0.01], [0.25, 0.25, 0.25, 0.25]
    lm = _FixedLM([confident, confident, unsure, confident, confident])
    drafter = DraftModelDrafter(lm, DraftModelConfig(k=5, self_verify=True, tau=1.0))
    drafter.begin(np.array([1]))
    lm.start = 1
    tree = drafter.propose(np.array([1]), budget=8)
    assert tree.tokens.tolist() == [1, 0, 0, 0]  # stops after the third token: entropy ln 4 > 1.0
    # the verifier rejects the third token (entropy ln 4): τ becomes ln 4 and the next window runs to k
    drafter.observe(Verdict(tree, path=(1, 2), bonus=3, target_argmax=np.zeros(4, dtype=np.int64)), np.array([1]))
    assert drafter.threshold.value == pytest.approx(np.log(4))
    assert drafter.propose(np.array([1]), budget=8).num_drafted == 5
    assert drafter.report()["windows"] == [3, 5]


# ---------------------------------------------------------------- a draft head over a shortlist


def test_a_head_over_some_tokens_gives_those_columns_of_the_whole_heads_logits(target):
    tokens = [5, 1, 40, 63, 7]
    tree = chain(3, [9, 12], ["t", "t"])
    whole = target.forward_tree(target.new_cache(), tree).logits
    short = target.forward_tree(target.new_cache(), tree, head=target.head_over(tokens)).logits
    assert short.shape == (3, len(tokens))
    torch.testing.assert_close(short, whole[:, tokens], rtol=0, atol=1e-12)
    for bad in ([], [VOCAB], [-1]):
        with pytest.raises(InputError, match="head's tokens"):
            target.head_over(bad)


def test_a_shortlisted_draft_lm_spreads_its_scores_and_drafts_only_shortlisted_tokens(target, small):
    shortlist = list(range(0, VOCAB, 3))
    lm = DraftLM(small, head=small.head_over(shortlist))
    context = np.array(_prompts(1, seed=8)[0] + [4], dtype=np.int64)
    scores = lm.next_scores(context)
    whole = DraftLM(small).next_logits(context)
    torch.testing.assert_close(scores, whole[shortlist], rtol=0, atol=1e-12)
    spread = lm.next_logits(context)
    assert torch.isinf(spread[[t for t in range(VOCAB) if t not in shortlist]]).all()
    torch.testing.assert_close(spread[shortlist], whole[shortlist], rtol=0, atol=1e-12)
    drafter = DraftModelDrafter(lm, DraftModelConfig(k=6))
    drafter.begin(context)
    tree = drafter.propose(context, budget=6)
    assert tree.num_drafted == 6 and set(tree.tokens[1:].tolist()) <= set(shortlist)


def test_shortlist_tokens_keeps_the_most_frequent_and_the_end_tokens():
    assert shortlist_tokens(np.array([5, 0, 9, 1]), 2, always=[3]).tolist() == [2, 3]
    assert shortlist_tokens(np.array([5, 0, 9, 1, 9]), 3).tolist() == [0, 2, 4]  # ties to the lower id
    assert shortlist_tokens(np.array([5, 0, 9, 1]), 4) is None  # the whole vocabulary: nothing to save
    assert shortlist_tokens(np.array([5, 0, 9, 1]), 0) is None


def test_a_context_shortlists_draft_heads_from_its_suffix_stores(target, tmp_path):
    from hierspec.datastore.suffix import build_suffix_store

    store = tmp_path / "suffix"
    documents = [" ".join(["a b c"] * 20), "a b d e"]
    fingerprint, name = DrafterContext(target).fingerprint()
    build_suffix_store(documents, target.tokenizer, name, fingerprint, store)
    counts = np.zeros(target.vocab_size, dtype=np.int64)
    for text in documents:
        for token in target.tokenizer(text, add_special_tokens=False)["input_ids"]:
            counts[token] += 1
    context = DrafterContext(target, (str(store),), draft_vocab=6)
    expected = shortlist_tokens(counts, 6, sorted(target.eos_token_ids))
    assert context.draft_shortlist().tolist() == expected.tolist()
    lm = context.load_draft_lm("self:2", "sd")
    assert lm.tokens.tolist() == expected.tolist()
    assert DrafterContext(target, (str(store),), draft_vocab=0).load_draft_lm("self:2", "sd").head is None
    assert DrafterContext(target, find_default_stores=False).draft_shortlist() is None


# ---------------------------------------------------------------- greedy identity


def _check_identity(target, drafter, prompts, max_new_tokens=32):
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    plain = SpeculativeDecoder(target, NoDrafter())
    decoder = SpeculativeDecoder(target, drafter)
    accepted = 0
    for prompt in prompts:
        reference = plain.generate(prompt, config)
        result = decoder.generate(prompt, config)
        assert result.token_ids == reference.token_ids
        accepted += result.stats.accepted_drafts
    return accepted


@pytest.mark.parametrize("self_verify", [False, True])
def test_sd_with_a_separate_draft_model_reproduces_plain_decoding(target, small, self_verify):
    drafter = DraftModelDrafter(DraftLM(small), DraftModelConfig(k=5, self_verify=self_verify, tau=2.0))
    _check_identity(target, drafter, _prompts(6, seed=1))


def test_sd_and_hsddw_with_shortlist_heads_reproduce_plain_decoding(target, small):
    shortlist = list(range(0, VOCAB, 2))
    sd = DraftModelDrafter(DraftLM(small, head=small.head_over(shortlist)), DraftModelConfig(k=4))
    _check_identity(target, sd, _prompts(5, seed=6))
    middle = self_drafting_model(target, 3)
    hsddw = HSDDWDrafter(DraftModelDrafter(DraftLM(small, head=small.head_over(shortlist)), DraftModelConfig(k=3)),
                         DraftLM(middle, head=middle.head_over(shortlist)), HSDDWConfig(tau=2.5, max_block=8))
    assert _check_identity(target, hsddw, _prompts(5, seed=7)) > 0


def test_greedy_pre_verify_on_shortlist_scores_equals_the_whole_vocabulary_rows(target, small):
    """HSDDW's greedy round reads M2's shortlist scores as they come; its verdict, entropies and token
    probabilities equal those of the whole-vocabulary float64 rows (``-inf`` outside the shortlist)."""
    shortlist = list(range(0, VOCAB, 2))
    middle = DraftLM(small, head=small.head_over(shortlist))
    reference = DraftLM(small, head=small.head_over(shortlist))
    hsddw = HSDDWDrafter(PromptLookupDrafter(PromptLookupConfig()), middle)
    context = np.array([3, 8, 12, 8, 40], dtype=np.int64)
    first = int(shortlist[int(reference.next_scores(context).argmax())])
    reference.reset()
    proposal = chain(int(context[-1]), [first, 6, 10], ["x"] * 3, None)
    verdict, rows = hsddw._pre_verify(context, proposal)
    logits = reference.score_tree(context, proposal).to(torch.float64)
    assert verdict.path[:1] == (1,) and verdict.path == accept_greedy(proposal, logits).path
    for node, token, (h, chance, dist) in zip((0, *verdict.path), verdict.accepted_tokens, rows):
        probs = torch.softmax(logits[node], dim=-1)
        assert dist is None and token in shortlist
        assert h == pytest.approx(entropy(probs), rel=1e-9) and chance == pytest.approx(float(probs[token]), rel=1e-9)


def test_sd_self_drafting_reproduces_plain_decoding_and_gets_drafts_accepted(target):
    drafter = make_drafter("sd:draft=self:3,k=4,budget=off", DrafterContext(target))
    assert _check_identity(target, drafter, _prompts(6, seed=2)) > 0


def test_hsddw_reproduces_plain_decoding(target, small):
    drafter = HSDDWDrafter(
        DraftModelDrafter(DraftLM(small), DraftModelConfig(k=3, self_verify=True, tau=2.0)),
        DraftLM(self_drafting_model(target, 3)), HSDDWConfig(tau=2.5, max_block=10))
    assert _check_identity(target, drafter, _prompts(6, seed=3)) > 0
    report = drafter.report()
    assert report["rounds"] >= len(report["windows"]) and report["first_drafted"] >= report["first_accepted"]


def test_retrieval_first_hsddw_reproduces_plain_decoding(target):
    drafter = make_drafter("hsddw:first=pld,middle=self:3,tau=3,budget=off", DrafterContext(target))
    rng = np.random.default_rng(5)
    prompts = []
    for _ in range(5):
        motif = rng.integers(1, VOCAB, size=6).tolist()
        prompts.append(motif * 3 + motif[:2])
    _check_identity(target, drafter, prompts)
    assert drafter.report()["first_drafted"] > 0


def test_hd_with_a_draft_model_reproduces_plain_decoding_and_the_model_adds_tokens(target):
    """hd's databases pre-verified and continued by a draft model (issue 26: a draft model as one more source; 3 of
    the target's 4 layers, so that its tokens pass), cost-aware sizing off so that every step drafts."""
    hd = HierarchyDrafter(HierarchyConfig(l=1, m=4, order="act"), successors=SuccessorTable(VOCAB, 4))
    drafter = HSDDWDrafter(hd, DraftLM(self_drafting_model(target, 3)), HSDDWConfig(tau=3.0, max_block=8))
    rng = np.random.default_rng(9)
    prompts = [(motif := rng.integers(1, VOCAB, size=5).tolist()) * 3 + motif[:2] for _ in range(4)]
    assert _check_identity(target, drafter, prompts + _prompts(3, seed=9)) > 0
    report = drafter.report()
    assert report["first_drafted"] > 0 and report["middle_tokens"] > 0


def test_hd_takes_the_draft_model_from_its_option_or_the_command_line(target):
    context = DrafterContext(target, find_default_stores=False, draft_model="self:1")
    assert isinstance(make_drafter("hd:draft=off", context), HierarchyDrafter)
    # without --draft-model the default is hd alone; with one (draft=auto, the default) or draft=on, it drafts too
    assert isinstance(make_drafter("hd", DrafterContext(target, find_default_stores=False)), HierarchyDrafter)
    for with_cli in (make_drafter("hd", context), make_drafter("hd:draft=on", context)):
        assert isinstance(with_cli, CostAwareDrafter) and isinstance(with_cli.inner, HSDDWDrafter)
        assert isinstance(with_cli.inner.first, HierarchyDrafter)
        assert with_cli.inner.middle.model.model.config.num_hidden_layers == 1 and with_cli.inner.start.defer
    assert not make_drafter("hd:draft=on,defer=false", context).inner.start.defer
    named = make_drafter("hd:draft=self:2", DrafterContext(target, find_default_stores=False))
    assert named.inner.middle.model.model.config.num_hidden_layers == 2
    with pytest.raises(InputError, match="--draft-model"):
        make_drafter("hd:draft=on", DrafterContext(target, find_default_stores=False))
    # hsddw's first level is hd without a middle model of its own
    three = make_drafter("hsddw:first=hd,middle=self:3", context).inner
    assert isinstance(three.first, HierarchyDrafter) and three.middle.model.model.config.num_hidden_layers == 3
    assert draft_model_of("off", "m") is None and draft_model_of("on", "m") == "m"
    assert draft_model_of("auto", "m") == "m" and draft_model_of("auto", None) is None
    assert draft_model_of("self:2", None) == "self:2"


# ---------------------------------------------------------------- the draft model's deferred start


def test_draft_lm_counts_what_it_lacks_without_touching_its_cache(small):
    lm = DraftLM(small)
    context = np.array([4, 8, 15, 16, 23], dtype=np.int64)
    assert lm.lacks(context) == 4  # an empty cache lacks every token before the root
    lm.next_scores(context)  # the cache then holds all of context
    assert lm.lacks(np.append(context, [42, 7])) == 1  # 42; 7 is the root
    assert lm.lacks(np.array([4, 9, 1], dtype=np.int64)) == 1 and lm._tokens == context.tolist()


def test_draft_lm_prices_a_prompt_at_its_curves_widest_forward(small):
    assert DraftLM(small, step_cost=lambda rows: 2.0 + 0.5 * rows).prefill_ms(128) == pytest.approx(68.0)
    assert DraftLM(small).prefill_ms(128) == 0.0  # no curve: taken as free


def test_deferred_start_waits_until_the_forgone_steps_pay_for_the_prompt(small):
    """The draft reads a prompt at (2 + 0.5 * 64) / 64 = 0.53125 ms a token, a target step costs 4 ms, and a step
    without the draft forgoes half of one (2 ms). At step k (from 0) the context holds 40 + k tokens and the cache
    lacks 39 + k: without a head start the draft starts once 2k >= 0.53125 (39 + k), i.e. k >= 14.1: 15 steps
    deferred; with the default 8 steps' head start once 16 + 2k >= 0.53125 (39 + k), k >= 3.2: 4 steps."""
    prompt = np.arange(40, dtype=np.int64) % VOCAB
    for head_start, deferred in ((0, 15), (8, 4)):
        lm = DraftLM(small, step_cost=lambda rows: 2.0 + 0.5 * rows)
        start = DeferredStart(lm, head_start=head_start)
        ready = [start.ready(np.append(prompt, np.ones(k, dtype=np.int64)), lambda rows: 4.0) for k in range(20)]
        assert ready == [False] * deferred + [True] * (20 - deferred)
        assert start.deferred_steps == deferred and lm.forwards == 0
        start.begin()
        assert not start.started and start.deferred_steps == 0


def test_deferred_start_rents_no_more_than_a_best_case_draft_saves(small):
    """A target step costs 4 ms whatever its rows. A draft of up to 4 tokens at 3.6 ms each is at best
    max_d (1 + d) 4 / (3.6 d + 4) = 20 / 18.4 times faster (d = 4): a step without it forgoes 1 - 18.4/20 = 8 % of
    a step (0.32 ms), and a 40-token prompt's reading (0.5 ms a token) is never paid for in 20 steps; at 1 ms a token
    the best case is 2.5x, so the rent stays the fixed half step (3 steps deferred, as without ``deepest``:
    16 + 2k >= 0.5 (39 + k)); a draft as slow as the target forgoes nothing."""
    prompt = np.arange(40, dtype=np.int64) % VOCAB
    step = lambda rows: 4.0  # noqa: E731
    for per_token, share, deferred in ((3.6, 0.08, 20), (1.0, 0.5, 3), (4.0, 0.0, 20)):
        lm = DraftLM(small, step_cost=lambda rows, t=per_token: t if rows == 1 else 0.5 * rows)
        start = DeferredStart(lm, deepest=4)
        assert start.rent_share(step) == pytest.approx(share)
        ready = [start.ready(np.append(prompt, np.ones(k, dtype=np.int64)), step) for k in range(20)]
        assert ready == [False] * deferred + [True] * (20 - deferred)
    assert DeferredStart(lm).rent_share(step) == RENT  # without deepest: the rent as given
    assert DraftModelDrafter(lm, DraftModelConfig(k=3)).start.deepest == 3  # sd's drafts hold up to k tokens
    assert HSDDWDrafter(PromptLookupDrafter(PromptLookupConfig()), lm).start.deepest == 16  # a block at most
    assert DeferredStart(lm, deepest=4).ready(prompt[: CATCH_UP_ROWS + 1], step)  # nothing to read: at once
    with pytest.raises(ValueError, match="deepest"):
        DeferredStart(lm, deepest=0)


def test_deferred_start_starts_at_once_without_a_prompt_to_read_or_a_cost(small):
    priced = DraftLM(small, step_cost=lambda rows: 50.0)
    step = lambda rows: 1.0  # noqa: E731
    long = np.arange(60, dtype=np.int64) % VOCAB
    assert not DeferredStart(priced).ready(long, step)
    assert DeferredStart(priced).ready(long[: CATCH_UP_ROWS + 1], step)  # read in the same forward as the draft
    assert DeferredStart(priced).ready(long, None)  # the target's cost unknown
    assert DeferredStart(DraftLM(small)).ready(long, step)  # the draft's cost unknown
    assert DeferredStart(priced, defer=False).ready(long, step)  # defer=false
    with pytest.raises(ValueError, match="rent"):
        DeferredStart(priced, rent=0.0)
    with pytest.raises(ValueError, match="head_start"):
        DeferredStart(priced, head_start=-1)


def _windowed(drafter, target_ms, draft_ms):
    assert drafter.use_window(TokenWindow(target_ms, draft_ms))
    return drafter


def test_sd_and_hsddw_defer_their_draft_model_after_a_long_prompt_and_stay_lossless(target, small):
    """A 60-token prompt the draft's curve prices at 59 ms (1 ms a token), a 10 ms target step: ``sd`` decodes
    plainly while 8 x 5 + 5 k < 59 + k (k = 0..4: 5 steps), then drafts; ``hsddw`` sends prompt lookup's drafts alone
    meanwhile. Plain decoding's tokens throughout."""
    def draft_curve(rows):
        return 0.5 if rows == 1 else float(rows)

    rng = np.random.default_rng(4)
    motif = rng.integers(1, VOCAB, size=12).tolist()
    prompt = motif * 5  # 60 tokens that repeat: prompt lookup finds drafts
    lm = DraftLM(small, step_cost=draft_curve)
    sd = DraftModelDrafter(lm, DraftModelConfig(k=4))
    _windowed(sd, lambda rows: 10.0, sd.draft_cost)
    _check_identity(target, sd, [prompt], max_new_tokens=32)
    report = sd.report()
    assert report["deferred_steps"] == 5 and report["draft_forwards"] > 0 and report["windows"]
    middle = DraftLM(self_drafting_model(target, 3), step_cost=draft_curve)
    hsddw = HSDDWDrafter(PromptLookupDrafter(PromptLookupConfig()), middle, HSDDWConfig(tau=3.0, max_block=8))
    _windowed(hsddw, lambda rows: 10.0, hsddw.draft_cost)
    assert _check_identity(target, hsddw, [prompt], max_new_tokens=32) > 0
    report = hsddw.report()
    assert report["deferred_steps"] > 0 and report["middle_forwards"] > 0
    unwindowed = DraftModelDrafter(DraftLM(small, step_cost=draft_curve), DraftModelConfig(k=4))
    _check_identity(target, unwindowed, [prompt], max_new_tokens=8)
    assert unwindowed.report()["deferred_steps"] == 0  # without the target's cost: the old behaviour


def test_hsddw_flags_its_retrieval_level_sent_before_the_middle_model_starts_as_free(target, small):
    """While the middle model waits to start on a 60-token prompt (its reading priced at 59 ms against 10 ms target
    steps), ``propose`` returns prompt lookup's own draft and says it is free (the cost-aware wrapper then cuts it
    as a free proposal); a block drafted with the middle model, or a first draft model's empty step, is not."""
    rng = np.random.default_rng(4)
    prompt = np.array(rng.integers(1, VOCAB, size=12).tolist() * 5)
    middle = DraftLM(small, step_cost=lambda rows: 0.5 if rows == 1 else float(rows))
    hsddw = _windowed(HSDDWDrafter(PromptLookupDrafter(PromptLookupConfig()), middle, HSDDWConfig(max_block=8)),
                      lambda rows: 10.0, lambda tokens: 0.5 * tokens)
    hsddw.prepare(SamplingConfig(), torch.Generator())
    hsddw.begin(prompt)
    tree = hsddw.propose(prompt, 8)
    assert hsddw.proposed_free and tree.num_drafted > 0 and middle.forwards == 0
    started = _windowed(HSDDWDrafter(PromptLookupDrafter(PromptLookupConfig()), middle,
                                     HSDDWConfig(max_block=8, defer=False)),
                        lambda rows: 10.0, lambda tokens: 0.5 * tokens)
    started.prepare(SamplingConfig(), torch.Generator())
    started.begin(prompt)
    started.propose(prompt, 8)
    assert not started.proposed_free and middle.forwards > 0
    waiting = _windowed(HSDDWDrafter(DraftModelDrafter(DraftLM(small, step_cost=lambda rows: 0.5),
                                                       DraftModelConfig(k=2)), middle, HSDDWConfig(max_block=8)),
                        lambda rows: 10.0, lambda tokens: 0.5 * tokens)
    waiting.begin(prompt)
    assert waiting.propose(prompt, 8).num_drafted == 0 and not waiting.proposed_free


def test_steps_the_cost_aware_plan_skips_count_toward_the_draft_models_start(target, small):
    """A draft step at 6 ms against a flat 10 ms target step: at the prior's one-in-two acceptance drafting does not
    pay (1.5 tokens in 16 ms), so the plan skips every step but the explorations (every 8th) until it has seen the
    draft accepted. A 60-token prompt the draft's curve prices at 59 ms starts ``sd``'s draft after 16 steps of rent:
    its 4-token drafts are at best 50 / 34 times faster than plain decoding, so a step without it forgoes 1 - 34/50
    of a step, 3.2 ms (8 x 3.2 + 3.2 k >= 59 + k); HSDDW's middle model, whose block of 4 is priced as 4 tokens of
    its own, after 16 as well (at the uncapped half step, before the sixty-third session: 5); were only the
    explorations counted, 40 steps would not reach either and nothing would ever be drafted or learnt. Plain
    decoding's tokens either way."""
    def draft_curve(rows):
        return 6.0 if rows == 1 else float(rows)

    rng = np.random.default_rng(4)
    motif = rng.integers(1, VOCAB, size=12).tolist()
    prompt = motif * 5
    for drafter, deferred in (
            (DraftModelDrafter(DraftLM(small, step_cost=draft_curve), DraftModelConfig(k=4)), 16),
            (HSDDWDrafter(DraftModelDrafter(DraftLM(small, step_cost=lambda rows: 0.0), DraftModelConfig(k=2)),
                          DraftLM(self_drafting_model(target, 3), step_cost=draft_curve),
                          HSDDWConfig(tau=3.0, max_block=4)), 16)):
        wrapped = CostAwareDrafter(drafter, lambda rows: 10.0)
        _check_identity(target, wrapped, [prompt], max_new_tokens=40)
        report = drafter.report()
        assert wrapped.skipped_steps > 0  # the plan skipped steps before it learnt the draft's acceptance
        assert report["deferred_steps"] == deferred, report  # counted on skipped steps too
        forwards = report["draft_forwards"] if "draft_forwards" in report else report["middle_forwards"]
        assert forwards > 0, (type(drafter).__name__, report)  # the explorations after the start drafted


def test_hsddw_whose_middle_model_cannot_pay_sends_its_retrieval_drafts_alone(target):
    """A middle round priced at 9.6 ms against a 10 ms target step can never pay (at best under 1.05x), so the plan
    skips every step: prompt lookup's drafts go to the target without the middle model — plain decoding's tokens,
    drafts verified, no middle forward. A first level that is itself a draft model has nothing free to offer: those
    steps decode plainly."""
    rng = np.random.default_rng(6)
    prompts = [(motif := rng.integers(1, VOCAB, size=6).tolist()) * 4 + motif[:2] for _ in range(3)]
    config = GenerationConfig(max_new_tokens=24)
    plain = SpeculativeDecoder(target, NoDrafter())
    middle = DraftLM(self_drafting_model(target, 3), step_cost=lambda rows: 9.6)
    first_model = DraftModelDrafter(DraftLM(self_drafting_model(target, 2), step_cost=lambda rows: 9.6),
                                    DraftModelConfig(k=3))
    for first, drafts in ((PromptLookupDrafter(PromptLookupConfig()), True), (first_model, False)):
        drafter = CostAwareDrafter(HSDDWDrafter(first, middle, HSDDWConfig(tau=3.0, max_block=8)),
                                   lambda rows: 10.0)
        decoder = SpeculativeDecoder(target, drafter)
        drafted = 0
        for prompt in prompts:
            result = decoder.generate(prompt, config)
            assert result.token_ids == plain.generate(prompt, config).token_ids
            assert result.stats.drafter["cost_skipped_steps"] == result.stats.target_forwards
            assert middle.forwards == 0
            drafted += result.stats.drafted_tokens
        assert (drafted > 0) == drafts


def test_sd_methods_parse_their_options(target):
    drafter = make_drafter("sd:draft=self:2,k=6,self_verify=true,tau=0.5,budget=off", DrafterContext(target))
    assert drafter.config == DraftModelConfig(k=6, self_verify=True, tau=0.5)
    assert drafter.lm.model.model.config.num_hidden_layers == 2
    cli = make_drafter("sd", DrafterContext(target, draft_model="self:1")).inner  # cost-aware by default
    assert cli.lm.model.model.config.num_hidden_layers == 1 and cli.start.defer
    assert not make_drafter("sd:defer=false", DrafterContext(target, draft_model="self:1")).inner.start.defer
    assert not make_drafter("hsddw:defer=false", DrafterContext(target, draft_model="self:1")).inner.start.defer
    with pytest.raises(InputError, match="self:K"):
        make_drafter("sd:draft=self:x", DrafterContext(target))
    assert make_drafter("sd:draft=self:0.5,budget=off", DrafterContext(target)).lm.model.model.config.num_hidden_layers == 2
    # --draft-model alone is HSDDW's middle level under prompt lookup; with --middle-model (or first=sd) its first
    pair = make_drafter("hsddw", DrafterContext(target, draft_model="self:1")).inner
    assert isinstance(pair.first, PromptLookupDrafter) and pair.middle.model.model.config.num_hidden_layers == 1
    both = make_drafter("hsddw", DrafterContext(target, draft_model="self:1", middle_model="self:3")).inner
    assert isinstance(both.first, DraftModelDrafter) and both.first.lm.model.model.config.num_hidden_layers == 1
    assert both.middle.model.model.config.num_hidden_layers == 3
    first_sd = make_drafter("hsddw:first=sd,middle=self:2", DrafterContext(target, draft_model="self:1")).inner
    assert isinstance(first_sd.first, DraftModelDrafter) and first_sd.middle.model.model.config.num_hidden_layers == 2
    assert isinstance(make_drafter("hsddw", DrafterContext(target)).inner.first, PromptLookupDrafter)
    with pytest.raises(InputError, match="first drafter"):
        make_drafter("hsddw:first=ar", DrafterContext(target))
    assert root_only(1).num_drafted == 0
