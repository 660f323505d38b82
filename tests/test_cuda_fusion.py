"""Fused layers for CUDA graphs (:mod:`hierspec.runtime.cuda_fusion`), the parts that run on the CPU.

The Triton kernels themselves run in ``tests/test_cuda.py`` (they need a GPU). Here the fused forwards — with the
kernels' PyTorch references in their place — are checked against transformers' own forward on every supported
architecture (this is where a change in transformers' attention module fails loudly), and the graphed runtime with
them gives plain decoding's tokens for every method in float64.
"""

import copy

import pytest
import torch

from hierspec.config import GenerationConfig
from hierspec.runtime import RuntimeConfig, cuda_fusion
from hierspec.runtime.decoder import unsupported_reason
from hierspec.target import TargetModel
from tiny import (accepted_drafts_of_methods_equal_to_plain, assert_graphed_rows_exact, make_model, make_tokenizer,
                  motif_prompts)

VOCAB = 64


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_forwards_compute_what_transformers_forward_computes(arch):
    """The whole model's logits over a prompt, with and without a cache, match the stock forward (float64, the
    kernels' references); the q/k/v and gate/up weights are views of one tensor, not copies."""
    if arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        torch.manual_seed(2)
        model = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                 sliding_window=None, initializer_range=0.5,
                                                 eos_token_id=0)).to(torch.float64).eval()
    else:
        model = make_model(arch, vocab_size=VOCAB, seed=2, layers=3)
    assert unsupported_reason(model) is None  # an architecture the fused layers take
    model.set_attn_implementation("sdpa")
    fused = copy.deepcopy(model)
    cuda_fusion.install(fused, cuda_fusion.REFERENCE_OPS)
    attention, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert attention.q_proj.weight.untyped_storage().data_ptr() == attention.v_proj.weight.untyped_storage().data_ptr()
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    ids = torch.randint(1, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=1e-10, atol=1e-10)
        first, rest = ids[:, :12], ids[:, 12:]
        stock_cache = model(first, use_cache=True).past_key_values
        fused_cache = fused(first, use_cache=True).past_key_values
        torch.testing.assert_close(fused(rest, past_key_values=fused_cache).logits,
                                   model(rest, past_key_values=stock_cache).logits, rtol=1e-10, atol=1e-10)
    parameters = sum(p.numel() for p in fused.parameters())
    assert parameters == sum(p.numel() for p in model.parameters())
    assert set(fused.state_dict()) == set(model.state_dict())  # the concatenated weights are not saved
    with torch.no_grad():  # the concatenated weights move with the model
        torch.testing.assert_close(fused.to(torch.float32)(ids).logits, model.to(torch.float32)(ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_the_references_round_once_in_float32():
    """Each reference computes in float32 and rounds once (the kernels' arithmetic), on values where transformers'
    step-by-step bfloat16 rounding would differ: the norm's row, the rotary sum, SiLU times up."""
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    weight = torch.randn(8, dtype=torch.bfloat16)
    wide = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(cuda_fusion.reference_rms_norm(x, weight, 1e-6),
                       (weight.float() * wide.to(torch.bfloat16).float()).to(torch.bfloat16))
    gate_up = torch.randn(2, 6, dtype=torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert torch.equal(cuda_fusion.reference_silu_mul(gate_up), (gate * torch.sigmoid(gate) * up).to(torch.bfloat16))
    q, k = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16), torch.randn(1, 1, 3, 4, dtype=torch.bfloat16)
    cos, sin = torch.randn(1, 3, 4, dtype=torch.bfloat16), torch.randn(1, 3, 4, dtype=torch.bfloat16)
    q_out, _ = cuda_fusion.reference_rotary(q, k, cos, sin)
    x1, x2 = q.float()[..., :2], q.float()[..., 2:]
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    expected = torch.cat((x1 * c[..., :2] - x2 * s[..., :2], x2 * c[..., 2:] + x1 * s[..., 2:]), dim=-1)
    assert torch.equal(q_out, expected.to(torch.bfloat16))


def test_fused_layers_run_on_cuda_graphs_only():
    model = make_model("llama", vocab_size=VOCAB, seed=1, layers=2)
    static = TargetModel(model, make_tokenizer(VOCAB), "tiny", RuntimeConfig(kind="graphs"))
    assert not static.runtime.fused_layers and static.runtime.describe()["decoder"] == "transformers"
    assert "CUDA" in cuda_fusion.unavailable(model, torch.device("cpu"), torch.bfloat16)
    assert "float64" in cuda_fusion.unavailable(model, torch.device("cuda"), torch.float64)


@pytest.fixture
def fused_static(monkeypatch):
    """A tiny float64 model on the graphed runtime with fused layers, run uncaptured on the CPU with the kernels'
    references in place of the Triton kernels."""
    monkeypatch.setattr(cuda_fusion, "unavailable", lambda model, device, dtype: None)
    monkeypatch.setattr(cuda_fusion, "TRITON_OPS", cuda_fusion.REFERENCE_OPS)
    model = make_model("qwen2", vocab_size=VOCAB, seed=4, layers=3)
    static = TargetModel(copy.deepcopy(model), make_tokenizer(VOCAB), "fused",
                         RuntimeConfig(kind="graphs", buckets=(16,)))
    assert static.runtime.fused_layers and static.runtime.describe()["decoder"] == "transformers-fused"
    stock = TargetModel(copy.deepcopy(model), make_tokenizer(VOCAB), "stock",
                        RuntimeConfig(kind="graphs", buckets=(16,), decoder="transformers"))
    assert not stock.runtime.fused_layers
    return static, stock


def test_the_fused_graphed_path_gives_chains_and_trees_plain_decodings_logits(fused_static):
    static, _ = fused_static
    assert_graphed_rows_exact(static)


def test_every_method_on_the_fused_graphed_path_equals_plain_decoding(fused_static):
    static, stock = fused_static
    methods = ("ar", "pld:budget=off", "hd")
    accepted = accepted_drafts_of_methods_equal_to_plain(static, motif_prompts(VOCAB), methods,
                                                         GenerationConfig(max_new_tokens=40), plain_target=stock)
    assert accepted > 0


def test_transformers_generate_runs_the_stock_modules(fused_static):
    """``TargetModel.stock()`` (transformers' ``generate`` as a bench peer) takes the fused forwards off and puts
    them back afterwards."""
    static, stock = fused_static
    norm = static.model.model.layers[0].input_layernorm
    assert "forward" in vars(norm)
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with static.stock(), torch.no_grad():
        assert "forward" not in vars(norm) and "forward" not in vars(static.model.model.layers[1].self_attn)
        assert torch.equal(static.model(ids).logits, stock.model(ids).logits)
    assert "forward" in vars(norm) and "forward" in vars(static.model.model.layers[1].mlp)
