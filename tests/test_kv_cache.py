"""After dropping rejected tree nodes, the KV cache equals the cache of plain decoding over the same tokens."""

import pytest
import torch

from hierspec.tree import build_tree
from tiny import ARCHITECTURES, make_target


def _assert_same_cache(cache, reference):
    assert cache.get_seq_length() == reference.get_seq_length()
    for layer, ref in zip(cache.layers, reference.layers):
        torch.testing.assert_close(layer.keys, ref.keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(layer.values, ref.values, rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("branch", [0, 1, 2, 3])
def test_compacted_cache_equals_plain_cache(arch, branch):
    target = make_target(arch, vocab_size=32, seed=1)
    prompt = [5, 9, 2, 7, 11]
    # BFS tokens [11 | 1, 4, 8, 2, 6, 3]: path (1,) is a prefix of the BFS order (a plain crop); the others gather
    tree = build_tree(prompt[-1], [[1, 2], [4], [8, 3], [1, 6]])
    assert tree.tokens.tolist() == [11, 1, 4, 8, 2, 6, 3]
    paths = {0: [1], 1: [1, 4], 2: [3, 6], 3: [1, 5]}
    keep = [0] + paths[branch]
    cache = target.new_cache()
    target.prefill(cache, prompt[:-1])
    past = cache.get_seq_length()
    target.forward_tree(cache, tree)
    target.keep_path(cache, past, keep)

    accepted = [int(tree.tokens[i]) for i in keep[1:]]
    reference = target.new_cache()
    target.prefill(reference, prompt + accepted)
    _assert_same_cache(cache, reference)


def test_tree_logits_equal_sequential_logits():
    target = make_target("llama", vocab_size=32, seed=2)
    prompt = [3, 1, 4, 1, 5]
    tree = build_tree(prompt[-1], [[9, 2, 6], [5, 3], [9, 8]])
    cache = target.new_cache()
    target.prefill(cache, prompt[:-1])
    logits = target.forward_tree(cache, tree).logits
    for node in range(tree.size):
        ids = torch.tensor([prompt + tree.sequence(node)])
        with torch.inference_mode():
            expected = target.model(input_ids=ids).logits[0, -1]
        torch.testing.assert_close(logits[node], expected, rtol=0, atol=1e-9)


def test_the_compiled_path_move_equals_the_per_layer_one(monkeypatch):
    from hierspec.runtime import int4_kernel, kv_cache
    from hierspec.runtime.kv_cache import TreeCache

    module, reason = int4_kernel.compiled_kernel()
    if module is None:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        states = [(torch.randn(1, 3, 12, 8, generator=gen).to(dtype), torch.randn(1, 3, 12, 8, generator=gen).to(dtype))
                  for _ in range(4)]
        caches = []
        for compiled in (True, False):
            cache = TreeCache(4, capacity=16)
            for index, (k, v) in enumerate(states):
                cache.update(k.clone(), v.clone(), index)
            monkeypatch.setattr(kv_cache, "loaded_kernel", (lambda: module) if compiled else (lambda: None))
            cache.keep(5, [0, 2, 3, 6])
            caches.append(cache)
        for fast, slow in zip(*(c.layers for c in caches)):
            assert fast.length == slow.length == 9
            assert torch.equal(fast.keys, slow.keys) and torch.equal(fast.values, slow.values)
        assert torch.equal(caches[0].layers[0].keys[0, :, 6], states[0][0][0, :, 7])  # entry 5 + 2 -> slot 6
    buffer = torch.zeros(1, 1, 8, 4)
    for bad in ([1, 0], [0, 0], [0, 9]):
        with pytest.raises(RuntimeError):
            module.keep_entries([buffer], 0, torch.tensor(bad))


def test_a_float16_cache_stores_entries_rounded_and_refuses_ones_beyond_its_range():
    from hierspec.errors import InputError
    from hierspec.runtime.kv_cache import TreeCache

    cache = TreeCache(1, 8, storage_dtype=torch.float16)
    keys, values = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    held_keys, held_values = cache.layers[0].update(keys, values)
    assert held_keys.dtype == torch.float16 and torch.equal(held_keys, keys.half())
    assert torch.equal(held_values, values.half())
    for bad in (keys * 1e5, keys.masked_fill(keys > 0, float("nan")), keys.masked_fill(keys < 0, -float("inf"))):
        with pytest.raises(InputError, match="--kv-cache model"):
            cache.layers[0].update(values, bad)
        assert cache.layers[0].get_seq_length() == 3 and torch.equal(cache.layers[0].keys, keys.half())  # untouched
    edge = torch.full((1, 2, 1, 4), 65504.0)  # float16's largest value is stored as it is
    assert torch.equal(cache.layers[0].update(edge, -edge)[0][:, :, 3:4], edge.half())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_cache_goes_to_the_model_under_the_keyword_its_forward_names(arch):
    """transformers renamed ``past_key_values`` to ``cache`` (the old name leaves in 5.40): the keyword hierspec
    passes must be one the model's forward names, the model must fill the cache through it, and no deprecation
    warning may come of it. Fails loudly when transformers renames it again."""
    import inspect
    import warnings

    from hierspec.runtime.kv_cache import TreeCache, cache_argument

    model = make_target(arch, vocab_size=32, seed=3).model
    cache = TreeCache(model.config.num_hidden_layers)
    (keyword,) = cache_argument(model, cache)
    assert keyword in inspect.signature(type(model).forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=torch.tensor([[3, 5, 7]]), **cache_argument(model, cache), use_cache=True)
    assert cache.get_seq_length() == 3
