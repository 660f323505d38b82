"""Exact tree attention for CUDA graphs (:mod:`hierspec.runtime.cuda_attention`), the parts that run on the CPU.

The Triton kernel itself runs in ``tests/test_cuda.py`` (it needs a GPU); here: the row plans it reads say what
the CPU's exact attention and the boolean tree masks say, the attention function hands a plan to the kernel, and
the graphed runtime's plan path — with the kernel's row-by-row reference standing in for it — gives plain
decoding's tokens exactly in float64.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hierspec.config import GenerationConfig
from hierspec.errors import InputError
from hierspec.runtime import RuntimeConfig, cuda_attention
from hierspec.runtime.attention import tree_attention
from hierspec.runtime.exact_attention import ExactPlan
from hierspec.target import TargetModel
from hierspec.tree import build_tree, padded_ancestor_matrix
from tiny import (accepted_drafts_of_methods_equal_to_plain, assert_graphed_rows_exact, make_model, make_tokenizer,
                  motif_prompts)

VOCAB = 64


def _random_tree(rng: np.random.Generator):
    sequences = [rng.integers(1, 50, size=int(rng.integers(1, 6))).tolist() for _ in range(int(rng.integers(1, 5)))]
    for sequence in sequences[1:]:  # share a prefix with the first sequence, then branch off
        shared = min(int(rng.integers(0, 3)), len(sequence) - 1)
        sequence[:shared] = sequences[0][:shared]
    return build_tree(int(rng.integers(1, 50)), sequences)


def test_row_plans_name_the_slots_the_cpu_exact_attention_reads():
    rng = np.random.default_rng(0)
    for _ in range(30):
        tree = _random_tree(rng)
        past, rows = int(rng.integers(0, 40)), tree.size + int(rng.integers(0, 6))
        plan = torch.from_numpy(cuda_attention.row_plan(padded_ancestor_matrix(tree, rows), past))
        expected = ExactPlan.of_tree(tree.parents, past, rows)
        for row in range(rows):
            slots = expected.indices[expected.indptr[row] : expected.indptr[row + 1]]
            assert cuda_attention.plan_slots(plan, row).tolist() == slots.tolist(), row


def test_a_row_plan_attends_what_the_boolean_tree_mask_attends():
    """The reference of the kernel over a plan equals SDPA over the same forward's boolean mask (float64)."""
    rng = np.random.default_rng(1)
    heads, kv_heads, dim, width = 6, 2, 16, 48
    for _ in range(10):
        tree = _random_tree(rng)
        past, rows = int(rng.integers(1, 30)), tree.size + int(rng.integers(0, 4))
        block = padded_ancestor_matrix(tree, rows)
        plan = cuda_attention.row_plan(block, past)
        mask = torch.zeros((rows, width), dtype=torch.bool)
        mask[:, :past] = True
        mask[:, past : past + rows] = torch.from_numpy(block)
        query = torch.randn(1, heads, rows, dim, dtype=torch.float64)
        key, value = (torch.randn(1, kv_heads, width, dim, dtype=torch.float64) for _ in range(2))
        got = cuda_attention.attend_reference(query, key, value, torch.from_numpy(plan), 0.25)
        expected = F.scaled_dot_product_attention(query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1),
                                                  attn_mask=mask[None, None], scale=0.25).transpose(1, 2)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_the_attention_function_hands_an_int32_plan_to_the_exact_kernel(monkeypatch):
    calls = []

    def kernel(query, key, value, plan, scale):
        calls.append((plan.shape, scale))
        return cuda_attention.attend_reference(query, key, value, plan, scale)

    monkeypatch.setattr(cuda_attention, "attend", kernel)
    tree = build_tree(3, [[4, 5], [6]])
    plan = torch.from_numpy(cuda_attention.row_plan(padded_ancestor_matrix(tree, 4), 10))[None, None]
    query = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    key, value = (torch.randn(1, 2, 20, 8, dtype=torch.float64) for _ in range(2))
    out, _ = tree_attention(None, query, key, value, plan, scaling=0.5)
    assert calls == [((4, 6), 0.5)]
    assert torch.equal(out, cuda_attention.attend_reference(query, key, value, plan[0, 0], 0.5))


def test_exact_attention_needs_cuda_graphs_with_triton_or_the_cpu_decoder():
    model = make_model("llama", vocab_size=VOCAB, seed=1, layers=2)
    with pytest.raises(InputError, match="Triton"):
        TargetModel(model, make_tokenizer(VOCAB), "tiny", RuntimeConfig(kind="graphs", attention="exact"))
    static = TargetModel(model, make_tokenizer(VOCAB), "tiny", RuntimeConfig(kind="graphs"))
    assert not static.runtime.graph_exact  # the CPU: the boolean mask and SDPA
    assert cuda_attention.unavailable(torch.device("cpu"), torch.bfloat16) is not None
    assert "float64" in cuda_attention.unavailable(torch.device("cuda"), torch.float64)


@pytest.fixture
def planned_static(monkeypatch):
    """A tiny float64 model on the graphed runtime's row-plan path, run uncaptured on the CPU with the kernel's
    reference in place of the Triton kernel."""
    monkeypatch.setattr(cuda_attention, "unavailable", lambda device, dtype: None)
    monkeypatch.setattr(cuda_attention, "attend", cuda_attention.attend_reference)
    model = make_model("qwen2", vocab_size=VOCAB, seed=4, layers=3)
    # one bucket, as on CUDA in bfloat16: the CPU's float64 products of 1 and 2 rows differ in the last bits
    static = TargetModel(copy.deepcopy(model), make_tokenizer(VOCAB), "planned",
                         RuntimeConfig(kind="graphs", buckets=(16,)))
    assert static.runtime.graph_exact and static.runtime.describe()["attention"] == "exact"
    eager = TargetModel(model, make_tokenizer(VOCAB), "eager", RuntimeConfig(kind="eager"))
    return static, eager


def test_the_row_plan_path_gives_chains_and_trees_plain_decodings_logits(planned_static):
    static, _ = planned_static
    assert_graphed_rows_exact(static)


def test_every_method_on_the_row_plan_path_equals_plain_decoding(planned_static):
    static, eager = planned_static
    methods = ("ar", "pld:budget=off", "hd")
    accepted = accepted_drafts_of_methods_equal_to_plain(static, motif_prompts(VOCAB), methods,
                                                         GenerationConfig(max_new_tokens=40), plain_target=eager)
    assert accepted > 0
