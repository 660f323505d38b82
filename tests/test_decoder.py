"""hierspec's own Llama-family decoder forward (:mod:`hierspec.runtime.decoder`) against transformers' modules."""

import copy

import numpy as np
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.runtime import RuntimeConfig, onednn
from hierspec.runtime.decoder import unsupported_reason
from hierspec.target import TargetModel
from hierspec.tree import build_tree
from tiny import accepted_drafts_of_methods_equal_to_plain, make_model, make_tokenizer

VOCAB = 64


def _mistral(dtype=torch.float64):
    torch.manual_seed(4)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           initializer_range=0.5, sliding_window=None, eos_token_id=0, pad_token_id=0)
    return MistralForCausalLM(config).to(dtype).eval()


def _pair(model, runtime: str = "auto") -> tuple[TargetModel, TargetModel]:
    """The same weights behind the owned decoder and behind transformers' modules, both attending with PyTorch's
    attention, so that float32 comparisons see the decoder's own arithmetic (exact attention's, the default, is
    compared with it in ``tests/test_exact_attention.py``)."""
    owned = TargetModel(model, make_tokenizer(VOCAB), "owned", RuntimeConfig(kind=runtime, attention="sdpa"))
    stock = TargetModel(copy.deepcopy(model), make_tokenizer(VOCAB), "stock",
                        RuntimeConfig(kind=runtime, decoder="transformers"))
    assert owned.runtime.decoder is not None and stock.runtime.decoder is None
    return owned, stock


TREES = ([], [[5, 6, 7], [5, 9], [11]], [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], [[1], [2], [3], [4], [5, 6]])


def _forwards(target: TargetModel, prompt: list[int], want_hidden: bool = False) -> list:
    cache = target.new_cache()
    hidden = target.prefill(cache, prompt[:-1], want_hidden=want_hidden)
    outputs = [hidden]
    for drafts in TREES:
        past = cache.get_seq_length()
        out = target.forward_tree(cache, build_tree(prompt[-1], drafts), want_hidden=want_hidden)
        outputs += [out.logits, out.hidden]
        target.keep_path(cache, past, [0])
        cache.crop(-1)
        prompt = prompt + [int(out.logits[0].argmax())]
        cache_past = cache.get_seq_length()
        target.forward_tree(cache, build_tree(prompt[-2], []))  # commit one more token
        target.keep_path(cache, cache_past, [0])
    return outputs


@pytest.mark.parametrize("make", [lambda: make_model("llama", VOCAB, seed=2, layers=3),
                                  lambda: make_model("qwen2", VOCAB, seed=3, layers=3), _mistral],
                         ids=["llama", "qwen2", "mistral"])
def test_owned_forward_equals_transformers_exactly_in_float64(make):
    owned, stock = _pair(make())
    prompt = np.random.default_rng(0).integers(1, VOCAB, size=23).tolist()
    for got, expected in zip(_forwards(owned, prompt, want_hidden=True), _forwards(stock, prompt, want_hidden=True)):
        assert got is not None and torch.equal(got, expected)


@pytest.mark.skipif(onednn.probe(torch.float32) is not None, reason="no oneDNN packing here")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_owned_forward_with_packed_products_matches_transformers_in_float32(arch):
    """The packed runtime's layers (compiled where the extension builds: their norm, rotation and activation round
    in other last bits than PyTorch's) stay within float32 rounding of transformers' forward: 1e-5 of the logits'
    scale (these tiny models' logits reach ~20)."""
    owned, stock = _pair(make_model(arch, VOCAB, seed=5, layers=3, dtype=torch.float32))
    assert owned.runtime.kind == "packed" and owned.runtime.packing is None  # the decoder packs its own products
    prompt = np.random.default_rng(1).integers(1, VOCAB, size=40).tolist()
    for got, expected in zip(_forwards(owned, prompt)[1::2], _forwards(stock, prompt)[1::2]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_every_method_on_the_owned_forward_equals_plain_decoding():
    owned, _ = _pair(make_model("qwen2", VOCAB, seed=7, layers=3))
    rng = np.random.default_rng(2)
    prompts = [motif * 3 + motif[:2] for motif in (rng.integers(1, VOCAB, size=5).tolist() for _ in range(3))]
    accepted = accepted_drafts_of_methods_equal_to_plain(owned, prompts, ("pld:budget=off", "hd",
                                                                          "sd:draft=self:2,k=4,budget=off"),
                                                         GenerationConfig(max_new_tokens=40), extend=0)
    assert accepted > 0


def test_models_outside_the_family_run_transformers_modules():
    model = make_model("llama", VOCAB, seed=1)
    assert unsupported_reason(model) is None
    model.config.hidden_act = "gelu"
    assert "activation" in unsupported_reason(model)
    target = TargetModel(model, make_tokenizer(VOCAB), "gelu")
    assert target.runtime.decoder is None and target.runtime.describe()["decoder"] == "transformers"
    assert len(SpeculativeDecoder(target, NoDrafter()).generate([3, 4, 5], GenerationConfig(
        max_new_tokens=5)).token_ids) == 5
    windowed = _mistral()
    windowed.config.sliding_window = 16
    assert "sliding" in unsupported_reason(windowed)


def test_rotary_table_grows_with_the_positions_asked_for():
    owned, stock = _pair(make_model("llama", VOCAB, seed=9, max_positions=512))
    prompt = np.random.default_rng(3).integers(1, VOCAB, size=480).tolist()
    got, expected = _forwards(owned, prompt), _forwards(stock, prompt)
    assert owned.runtime.decoder._cos.shape[0] == 512
    for a, b in zip(got[1::2], expected[1::2]):
        assert torch.equal(a, b)


def test_a_prompt_on_an_empty_cache_is_attended_causally_as_the_masked_forward_attends_it():
    """Prefill on an empty cache runs SDPA's causal path (no mask); its cache entries and last hidden state equal
    the masked path's (float64: the same sums up to their order), and a prompt prefilled in two parts (the second
    part masked, past the first) gives the same cache."""
    target = TargetModel(make_model("llama", vocab_size=VOCAB, seed=3, dtype=torch.float64), make_tokenizer(VOCAB),
                         "owned", RuntimeConfig())
    decoder = target.runtime.decoder
    prompt = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 2, 2, 7, 18, 28]])
    rows = prompt.shape[-1]
    positions = torch.arange(rows)[None]
    causal, masked, halves = (target.new_cache() for _ in range(3))
    _, fast = decoder.forward(prompt, positions, None, causal, slice(rows - 1, rows), want_hidden=True)
    mask = (torch.arange(rows)[None, :] <= torch.arange(rows)[:, None])[None, None]
    _, slow = decoder.forward(prompt, positions, mask, masked, slice(rows - 1, rows), want_hidden=True)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    target.prefill(halves, prompt[0, :5].tolist())
    target.prefill(halves, prompt[0, 5:].tolist())
    for a, b, c in zip(causal.layers, masked.layers, halves.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.values, c.values, rtol=1e-12, atol=1e-12)


def test_the_rotary_table_is_filled_after_a_small_single_threaded_evaluation():
    """The table (thousands of positions, shared between threads) is computed after the module ran on two positions:
    a process's first multi-threaded cos gave half a table other values in 3 of 16 processes on an Intel Xeon. The
    table holds exactly what the module computes."""
    from hierspec.runtime.decoder import build_decoder

    model = make_model("llama", vocab_size=VOCAB, seed=3, dtype=torch.float32)
    decoder = build_decoder(model, packed=False)
    calls = []
    rotary = decoder._rotary
    decoder._rotary = lambda probe, positions: calls.append(positions.shape[-1]) or rotary(probe, positions)
    decoder._rotation(torch.arange(10))
    size = decoder._cos.shape[0]  # the model's 512 positions here (4096 at most to start with)
    assert calls == [2, size] and size == 512
    cos, sin = rotary(decoder.embedding[:1][None], torch.arange(size)[None])
    assert torch.equal(decoder._cos, cos[0])
    half = decoder.head_dim // 2
    assert torch.equal(decoder._sin, torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1))


def test_stacked_weights_equal_converting_the_concatenation_bit_for_bit():
    """Projection's stacked copy (each weight converted as it is copied in) equals ``torch.cat(...).to(dtype)``,
    halfway values included, and is a new tensor even in the weights' own dtype."""
    from hierspec.runtime.decoder import _stacked

    generator = torch.Generator().manual_seed(3)
    weights = [torch.randn(5, 8, generator=generator), torch.randn(3, 8, generator=generator)]
    weights[1][0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-140])  # bfloat16 halfway, tiny
    for dtype in (torch.bfloat16, torch.float32):
        stacked = _stacked(weights, dtype)
        expected = torch.cat(weights).to(dtype)
        assert stacked.dtype == dtype and torch.equal(stacked.view(torch.int16 if dtype == torch.bfloat16 else
                                                                  torch.int32),
                                                      expected.view(torch.int16 if dtype == torch.bfloat16 else
                                                                    torch.int32))
    alone = _stacked(weights[:1], torch.float32)
    assert torch.equal(alone, weights[0]) and alone.data_ptr() != weights[0].data_ptr()
