"""The static-cache path that CUDA graphs replay (:mod:`hierspec.runtime.graphs`), run uncaptured on the CPU.

On CUDA the same code is captured into graphs (``tests/test_cuda.py`` checks replay against eager there); here it
runs eagerly in float64, so every method must give plain decoding's tokens exactly, and the one cache the runtime
keeps across generations must carry nothing from one generation into the next.
"""

import copy

import numpy as np
import pytest
import torch

from hierspec.config import GenerationConfig, SamplingConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.errors import InputError
from hierspec.methods import make_drafter
from hierspec.runtime import (GRAPH_BUCKETS, INVARIANT_GRAPH_BUCKETS, PACKED_BUCKETS, RuntimeConfig,
                              default_buckets)
from hierspec.runtime.graphs import MIN_CAPACITY, StaticTreeCache
from hierspec.target import TargetModel
from hierspec.tree import build_tree
from tiny import accepted_drafts_of_methods_equal_to_plain, make_model, make_tokenizer

VOCAB = 64
# budget=off: the drafts are verified whatever they cost (cost-aware drafting may skip them on a tiny model)
METHODS = ("pld:budget=off", "hd", "sd:draft=self:2,k=4,budget=off", "hsddw:first=pld,middle=self:3,budget=off")


def _targets(arch: str, seed: int = 3) -> tuple[TargetModel, TargetModel]:
    """The same tiny float64 model on the eager runtime and on the static (graphs) runtime."""
    model = make_model(arch, vocab_size=VOCAB, seed=seed, layers=4)
    eager = TargetModel(model, make_tokenizer(VOCAB), "eager", RuntimeConfig(kind="eager"))
    static = TargetModel(copy.deepcopy(model), make_tokenizer(VOCAB), "static", RuntimeConfig(kind="graphs"))
    return eager, static


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        motif = rng.integers(1, VOCAB, size=5).tolist()
        prompts.append(motif * 3 + rng.integers(1, VOCAB, size=int(rng.integers(1, 6))).tolist() + motif[:2])
    return prompts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_method_on_the_static_path_equals_plain_decoding(arch):
    eager, static = _targets(arch)
    assert static.runtime.kind == "graphs" and static.runtime.buckets[0] == 1
    accepted = accepted_drafts_of_methods_equal_to_plain(static, _prompts(4, seed=1), ("ar", *METHODS),
                                                         GenerationConfig(max_new_tokens=40), plain_target=eager)
    assert accepted > 0


def test_graphs_pad_every_forward_to_16_rows_on_cuda_in_low_precision_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert INVARIANT_GRAPH_BUCKETS[0] == 16 and set(INVARIANT_GRAPH_BUCKETS) <= set(GRAPH_BUCKETS)
    for dtype in (torch.bfloat16, torch.float16):
        assert default_buckets("graphs", cuda, dtype) == INVARIANT_GRAPH_BUCKETS
        assert default_buckets("graphs", cpu, dtype) == GRAPH_BUCKETS
    assert default_buckets("graphs", cuda, torch.float32) == GRAPH_BUCKETS
    assert default_buckets("packed", cpu, torch.bfloat16) == PACKED_BUCKETS
    assert default_buckets("eager", cuda, torch.bfloat16) == ()
    assert default_buckets("int4", cpu, torch.float32) == ()


def test_tree_logits_equal_the_eager_runtime_for_any_tree_and_bucket():
    eager, static = _targets("llama", seed=5)
    prompt = _prompts(1, seed=2)[0]
    tree = build_tree(prompt[-1], [[5, 6, 7], [5, 9], [11], [12, 13, 14, 15, 16]])
    reference_cache = eager.new_cache()
    eager.prefill(reference_cache, prompt[:-1])
    expected = eager.forward_tree(reference_cache, tree).logits
    for buckets in ((1, 2, 4, 8, 16), (16,), (64,)):
        static.runtime.buckets = buckets
        cache = static.new_cache()
        static.prefill(cache, prompt[:-1])
        got = static.forward_tree(cache, tree).logits
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        assert cache.get_seq_length() == len(prompt) - 1 + static.runtime.rows_for(tree.size)


def test_the_cache_is_reused_and_carries_nothing_between_generations():
    _, static = _targets("qwen2", seed=7)
    config = GenerationConfig(max_new_tokens=30)
    first, second = _prompts(2, seed=3)
    decoder = SpeculativeDecoder(static, make_drafter("pld", static))
    alone = decoder.generate(first, config).token_ids
    cache = static.new_cache()
    decoder.generate(second, GenerationConfig(max_new_tokens=60))
    assert static.new_cache() is cache  # one buffer per loaded model, kept
    assert decoder.generate(first, config).token_ids == alone


def test_the_cache_grows_for_long_generations_and_keeps_committed_entries():
    _, static = _targets("llama", seed=9)
    small = static.new_cache(10)
    assert small.capacity == MIN_CAPACITY
    big = static.new_cache(3 * MIN_CAPACITY)
    assert big is not small and big.capacity == 4 * MIN_CAPACITY
    assert static.new_cache(5).capacity == 4 * MIN_CAPACITY  # never shrinks back

    cache = StaticTreeCache(num_layers=2, kv_heads=1, head_dim=2, capacity=16, dtype=torch.float64, device="cpu")
    cache.buffer.copy_(torch.arange(cache.buffer.numel(), dtype=torch.float64).view_as(cache.buffer))
    before = cache.buffer.clone()
    cache.length = 9
    cache.keep(4, [0, 2, 5])  # entries 4, 6, 9 become 4, 5, 6
    assert cache.length == 7
    assert torch.equal(cache.buffer[..., 4:7, :], before[..., [4, 6, 9], :])
    assert torch.equal(cache.buffer[..., :4, :], before[..., :4, :])
    cache.crop(-2)
    assert cache.get_seq_length() == 5


def test_seeded_sampling_on_the_static_path_gives_the_eager_tokens():
    eager, static = _targets("llama", seed=11)
    config = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=0.8, top_p=0.95, seed=5))
    for prompt in _prompts(3, seed=4):
        for method in ("ar", "pld:budget=off", "sd:draft=self:2,k=3,budget=off"):
            runs = [SpeculativeDecoder(t, make_drafter(method, t)).generate(prompt, config).token_ids
                    for t in (eager, static)]
            assert runs[0] == runs[1], method


def test_unknown_runtime_kinds_are_refused():
    with pytest.raises(InputError, match="graphs"):
        RuntimeConfig(kind="compiled")
