"""A prompt's compiled causal attention (``prompt_attention.cpp``): close to PyTorch's SDPA for grouped and plain heads
of several sizes, on strided views and one or two threads; each row's bits independent of the prompt's length; bad
shapes refused; the int4 decoder reads prompts through it."""

import pytest
import torch
import torch.nn.functional as F

from hierspec.runtime.decoder import Int4Layers
from test_int4_attention import module  # noqa: F401 - the compiled extension, or a skip
from test_quantized import _int4_target, _tiny


def _prompt(rows: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    """Queries, keys and values as a packed q/k/v product's views ``[1, h, rows, dim]`` (not contiguous)."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(1, rows, heads + 2 * kv_heads, dim, generator=generator).transpose(1, 2)
    return states[:, :heads], states[:, heads : heads + kv_heads], states[:, heads + kv_heads :]


def _sdpa(query, keys, values, scale):
    out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale,
                                         enable_gqa=query.shape[1] != keys.shape[1])
    return out.transpose(1, 2).reshape(query.shape[2], -1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (12, 2, 128), (2, 1, 16)])
@pytest.mark.parametrize("rows", [1, 7, 24, 25, 61, 130])
def test_prompt_attention_is_close_to_sdpa(module, threads, heads, kv_heads, dim, rows):
    if not module.prompt_attention_fits(dim):
        pytest.skip(f"head size {dim} is not a multiple of this build's vector width")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        query, keys, values = _prompt(rows, heads, kv_heads, dim)
        out = module.prompt_attention(query, keys, values, dim ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (rows, heads * dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, _sdpa(query, keys, values, dim ** -0.5), rtol=1e-5, atol=2e-6)


def test_a_row_is_bit_identical_in_a_prompt_of_any_length(module):
    query, keys, values = _prompt(97, 9, 3, 64, seed=3)
    whole = module.prompt_attention(query, keys, values, 0.125)
    for rows in (1, 6, 23, 24, 50):
        part = module.prompt_attention(query[:, :, :rows], keys[:, :, :rows], values[:, :, :rows], 0.125)
        assert torch.equal(part, whole[:rows])


def test_contiguous_and_strided_inputs_give_the_same_bits(module):
    query, keys, values = _prompt(40, 9, 3, 64, seed=5)
    strided = module.prompt_attention(query, keys, values, 0.125)
    packed = module.prompt_attention(query.contiguous(), keys.contiguous(), values.contiguous(), 0.125)
    assert torch.equal(strided, packed)


def test_bad_shapes_and_dtypes_are_refused(module):
    query, keys, values = _prompt(8, 9, 3, 64)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        module.prompt_attention(query[:, :8], keys, values, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        module.prompt_attention(query.double(), keys.double(), values.double(), 0.125)
    with pytest.raises(RuntimeError, match=r"\[1, heads, rows, dim\]"):
        module.prompt_attention(query, keys[:, :, :4], values[:, :, :4], 0.125)
    assert not module.prompt_attention_fits(12) and not module.prompt_attention_fits(0)
    assert module.prompt_attention(query[:, :, :0], keys[:, :, :0], values[:, :, :0], 0.125).shape == (0, 9 * 64)


def test_the_int4_decoder_reads_prompts_through_the_kernel(module, monkeypatch, tmp_path):
    target = _int4_target(*_tiny(tmp_path))
    decoder = target.runtime.decoder
    if decoder._fused is None or not module.prompt_attention_fits(decoder.head_dim):
        pytest.skip("the int4 decoder runs without the compiled layers or the kernel's head sizes here")
    calls = []
    real = Int4Layers.prompt_attention

    def counted(self, *args):
        calls.append(args[0].shape)
        return real(self, *args)

    monkeypatch.setattr(Int4Layers, "prompt_attention", counted)
    ids = list(range(3, 40))
    cache = target.new_cache()
    target.prefill(cache, ids)
    assert len(calls) == len(decoder.layers) and calls[0][2] == len(ids)
