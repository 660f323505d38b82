"""The same guarantees on a CUDA device: every drafter, greedy and sampling, the loader's CUDA defaults, the bench.

Skipped where PyTorch sees no GPU (as on CI). Float64 on the GPU makes the outputs comparable exactly with the CPU:
greedy runs must be token-identical to plain decoding on the GPU, and a seeded sampling run must give the tokens
the same run gives on the CPU (acceptance draws from a CPU generator, so only a device mix-up can change them).
"""

import copy
import json

import numpy as np
import pytest
import torch

from hierspec.config import GenerationConfig, ModelConfig, SamplingConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.methods import DrafterContext, make_drafter
from hierspec.runtime import cuda_attention, cuda_fusion
from hierspec.target import TargetModel, load_model
from hierspec.tree import build_tree, padded_ancestor_matrix
from tiny import (accepted_drafts_of_methods_equal_to_plain, assert_chain_equals_steps, assert_tree_rows_equal_chains,
                  make_model, make_tokenizer, save_model_dir)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 64
# budget=off: every method drafts as its paper does, so the paths under test run (cost-aware drafting may skip them)
METHODS = ("pld:budget=off", "sd:draft=self:2,k=4,budget=off", "sd:draft=self:2,k=4,self_verify=true,budget=off",
           "hsddw:first=pld,middle=self:3,budget=off", "hsddw:first=sd,middle=self:3,budget=off")


def _pair(seed: int = 3) -> tuple[TargetModel, TargetModel]:
    """The same tiny float64 model on the CPU and on the GPU."""
    model = make_model("llama", vocab_size=VOCAB, seed=seed, layers=4)
    gpu = copy.deepcopy(model).to("cuda")
    return TargetModel(model, make_tokenizer(VOCAB), "tiny-cpu"), TargetModel(gpu, make_tokenizer(VOCAB), "tiny-gpu")


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        motif = rng.integers(1, VOCAB, size=5).tolist()
        prompts.append(motif * 2 + rng.integers(1, VOCAB, size=int(rng.integers(1, 8))).tolist() + motif[:2])
    return prompts


@pytest.fixture(scope="module")
def pair():
    return _pair()


def test_plain_decoding_on_the_gpu_matches_the_cpu_and_transformers(pair):
    cpu, gpu = pair
    assert gpu.device.type == "cuda"
    config = GenerationConfig(max_new_tokens=24)
    for prompt in _prompts(4, seed=1):
        ours = SpeculativeDecoder(gpu, NoDrafter()).generate(prompt, config).token_ids
        assert ours == SpeculativeDecoder(cpu, NoDrafter()).generate(prompt, config).token_ids
        with torch.inference_mode():
            ids = torch.tensor([prompt], device="cuda")
            out = gpu.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                     eos_token_id=0, pad_token_id=0)
        assert ours == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("method", METHODS)
def test_greedy_drafting_on_the_gpu_is_identical_to_plain_decoding(pair, method):
    cpu, gpu = pair
    config = GenerationConfig(max_new_tokens=32)
    decoder = SpeculativeDecoder(gpu, make_drafter(method, DrafterContext(gpu)))
    accepted = 0
    # Each prompt ends with the model's own continuation of it, so prompt lookup too finds drafts the model accepts
    # (on the CPU, in float64, these prompts give pld 2 accepted drafts and the model drafters 29 to 59).
    plain_cpu, plain_gpu = SpeculativeDecoder(cpu, NoDrafter()), SpeculativeDecoder(gpu, NoDrafter())
    for prompt in (p + plain_cpu.generate(p, config).token_ids for p in _prompts(5, seed=2)):
        result = decoder.generate(prompt, config)
        assert result.token_ids == plain_gpu.generate(prompt, config).token_ids
        accepted += result.stats.accepted_drafts
    assert accepted > 0


@pytest.mark.parametrize("method", ("ar",) + METHODS)
def test_seeded_sampling_on_the_gpu_gives_the_cpu_tokens(pair, method):
    cpu, gpu = pair
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=7)
    config = GenerationConfig(max_new_tokens=24, sampling=sampling)
    for prompt in _prompts(3, seed=3):
        runs = []
        for target in (cpu, gpu):
            drafter = make_drafter(method, DrafterContext(target))
            runs.append(SpeculativeDecoder(target, drafter).generate(prompt, config).token_ids)
        assert runs[0] == runs[1] and len(runs[0]) > 0


def test_loader_puts_the_model_on_the_gpu_in_bfloat16_by_default(tmp_path):
    directory = save_model_dir(tmp_path / "tiny", vocab_size=VOCAB, seed=5, dtype=torch.float32)
    auto = load_model(str(directory), ModelConfig(device="cuda"))
    assert auto.device.type == "cuda" and auto.dtype == torch.bfloat16
    exact = load_model(str(directory), ModelConfig(device="cuda", dtype="float32"))
    config = GenerationConfig(max_new_tokens=20)
    for prompt in _prompts(3, seed=4):
        reference = SpeculativeDecoder(exact, NoDrafter()).generate(prompt, config).token_ids
        assert SpeculativeDecoder(exact, make_drafter("pld", DrafterContext(exact))).generate(
            prompt, config).token_ids == reference
        assert len(SpeculativeDecoder(auto, make_drafter("pld", DrafterContext(auto))).generate(
            prompt, config).token_ids) > 0


def test_bench_runs_every_kind_of_method_on_the_gpu(tmp_path):
    from hierspec.bench.runner import BenchConfig, run_bench

    directory = save_model_dir(tmp_path / "tiny", vocab_size=VOCAB, seed=8, dtype=torch.float32, layers=3)
    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "qa", "turns": [" ".join(f"w{(i * 7 + j) % 60 + 1}" for j in range(12))]}
            for i in range(3)]
    questions.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    methods = ("hf-ar", "hf-pld", "hf-assisted", "pld", "hd:l=1", "sd", "hsddw")
    summary = run_bench(BenchConfig(questions=str(questions), methods=methods, max_new_tokens=16,
                                    out_dir=str(tmp_path / "out"), draft_model="self:1"),
                        ModelConfig(spec=str(directory), device="cuda", dtype="float32"))
    assert set(summary["methods"]) == {"ar", *methods}
    for method in ("hf-ar", "pld", "hd:l=1", "sd", "hsddw"):
        assert summary["methods"][method]["identical_to_ar"] == 1.0, method


def _graphed(dtype: torch.dtype, seed: int = 6) -> TargetModel:
    model = make_model("llama", vocab_size=VOCAB, seed=seed, layers=4).to(dtype).to("cuda")
    return TargetModel(model, make_tokenizer(VOCAB), "tiny-graphs")


def test_exact_attention_serves_float32_and_below_and_a_float64_model_keeps_sdpa(pair):
    _, gpu = pair
    assert gpu.runtime.kind == "graphs" and not gpu.runtime.graph_exact  # the kernel computes in float32
    assert gpu.runtime.describe()["attention"] == "sdpa"
    for dtype in (torch.float32, torch.bfloat16):
        assert _graphed(dtype).runtime.describe()["attention"] == "exact"


def test_cuda_runs_on_graphs_by_default_and_replay_equals_the_same_forward_uncaptured():
    target = _graphed(torch.float32)
    assert target.runtime.kind == "graphs"
    prompt = _prompts(1, seed=5)[0]
    trees = [build_tree(prompt[-1], []), build_tree(prompt[-1], [[5, 6, 7], [5, 9], [11, 12]])]
    replayed = []
    for _ in range(target.runtime.graphed.warmup + 2):  # eager warm-ups, the capture, then a replay
        cache = target.new_cache(64)
        target.prefill(cache, prompt[:-1])
        rows = []
        for tree in trees:
            past = cache.get_seq_length()
            rows.append(target.forward_tree(cache, tree).logits.clone())
            target.keep_path(cache, past, [0])
        replayed.append(rows)
    assert target.runtime.graphed.captures == 2
    for rows in replayed[1:]:
        for got, expected in zip(rows, replayed[0]):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_drafting_equals_graphed_plain_decoding_in_low_precision(dtype):
    """Batch invariance on the GPU: a token's logits do not depend on the tree or bucket it is verified in, so
    every method gives plain decoding's tokens in bfloat16 and float32 too."""
    accepted = accepted_drafts_of_methods_equal_to_plain(_graphed(dtype, seed=8), _prompts(5, seed=6),
                                                         ("pld:budget=off", "hd", "sd:draft=self:2,k=4,budget=off"),
                                                         GenerationConfig(max_new_tokens=40), extend=10)
    assert accepted > 0


def test_bfloat16_rows_in_a_tree_equal_the_same_rows_decoded_one_by_one_at_smollm2_size():
    """At SmolLM2's shapes cuBLAS multiplies up to 8 rows with other kernels than 16-64: every graphed forward in
    bfloat16 is padded to 16 rows or more, so a chain of any length verified in one forward gives plain decoding's
    logits bit for bit (with 1-row forwards for plain decoding, chains of 15 or more tokens differed in the last
    bits); and exact attention gives every node of a branching tree its chain's logits (with SDPA a node of a second
    branch, its ancestors at other slots, differed in the last bits)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    target = TargetModel(model, make_tokenizer(VOCAB), "smollm2-shaped")
    assert target.runtime.buckets[0] == 16 and target.runtime.graph_exact and target.runtime.fused_layers
    rng = np.random.default_rng(3)
    prompt, chain = rng.integers(2, 40000, size=300).tolist(), rng.integers(2, 40000, size=63).tolist()
    for length in (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 47, 63):
        assert_chain_equals_steps(target, prompt, chain[:length])
    assert_tree_rows_equal_chains(target, trees=8)


ONE_PASS, CHUNKED = cuda_attention.KernelShape(64, 8), cuda_attention.KernelShape(32, 4, chunk=128)


@pytest.mark.parametrize("shape", [None, ONE_PASS, CHUNKED], ids=["default", "one-pass", "chunked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (12, 2, 128), (4, 4, 32)])
def test_the_exact_kernel_computes_attention_and_a_rows_bits_do_not_depend_on_where_it_sits(dtype, heads, kv_heads,
                                                                                             dim, shape):
    """The Triton kernels (the default shape, one program a row, chunks of logical keys) against their row-by-row
    reference; and each node of a branching tree in a 16-row forward gives the same bits as the same token at the
    head of a 32-row forward with its path copied to consecutive slots (where plain decoding keeps it)."""
    torch.manual_seed(0)
    past, width = 300, 1024
    tree = build_tree(7, [[1, 2, 3, 4], [1, 5], [6, 7, 8], [9]])
    plan = torch.from_numpy(cuda_attention.row_plan(padded_ancestor_matrix(tree, 16), past)).cuda()
    query = torch.randn(1, 16, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)
    key, value = (torch.randn(1, kv_heads, width, dim, device="cuda", dtype=dtype) for _ in range(2))
    out = cuda_attention.attend(query, key, value, plan, dim ** -0.5, shape)
    expected = cuda_attention.attend_reference(query.double(), key.double(), value.double(), plan, dim ** -0.5)
    torch.testing.assert_close(out.double(), expected, **({"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16
                                                          else {"atol": 1e-5, "rtol": 1e-5}))
    kernel = lambda *inputs: cuda_attention.attend(*inputs, shape)  # noqa: E731
    assert cuda_attention.first_row_whose_bits_move(kernel, query, key, value, plan, tree.size, dim ** -0.5) is None


def test_bfloat16_rows_on_fused_layers_equal_plain_decoding_at_qwen2_size():
    """Qwen2.5-1.5B's layer shapes (q/k/v biases in the fused product, 128-wide heads, 6 query heads a key/value
    head), two layers: chains of any length and branching trees give plain decoding's logits bit for bit."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=4096, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=0, use_sliding_window=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    target = TargetModel(model, make_tokenizer(VOCAB), "qwen2-shaped")
    assert target.runtime.fused_layers and target.runtime.describe()["decoder"] == "transformers-fused"
    rng = np.random.default_rng(4)
    prompt, chain = rng.integers(2, 4000, size=200).tolist(), rng.integers(2, 4000, size=40).tolist()
    for length in (1, 3, 15, 16, 17, 40):
        assert_chain_equals_steps(target, prompt, chain[:length])
    assert_tree_rows_equal_chains(target, trees=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden,heads,kv_heads,dim,inner", [(576, 9, 3, 64, 1536), (1536, 12, 2, 128, 8960)])
def test_the_fused_kernels_compute_their_references_and_a_rows_bits_are_its_own(dtype, hidden, heads, kv_heads, dim,
                                                                                  inner):
    """The RMS norm, rotary and SiLU kernels against their PyTorch references (within a unit in the last place of
    the dtype), and each row's output the same bits computed alone as among 40 rows."""
    torch.manual_seed(0)
    rows = 40
    tolerance = {"atol": 2e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    x = torch.randn(1, rows, hidden, device="cuda", dtype=dtype)
    weight = torch.randn(hidden, device="cuda", dtype=dtype)
    qkv = torch.randn(1, rows, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    q = qkv[..., : heads * dim].view(1, rows, heads, dim).transpose(1, 2)
    k = qkv[..., heads * dim : (heads + kv_heads) * dim].view(1, rows, kv_heads, dim).transpose(1, 2)
    cos, sin = (torch.randn(1, rows, dim, device="cuda", dtype=dtype) for _ in range(2))
    gate_up = torch.randn(1, rows, 2 * inner, device="cuda", dtype=dtype)
    ops, reference = cuda_fusion.TRITON_OPS, cuda_fusion.REFERENCE_OPS
    norm = ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(norm, reference.rms_norm(x, weight, 1e-5), **tolerance)
    rotated = ops.rotary(q, k, cos, sin)
    for got, expected in zip(rotated, reference.rotary(q, k, cos, sin)):
        torch.testing.assert_close(got, expected, **tolerance)
    silu = ops.silu_mul(gate_up)
    torch.testing.assert_close(silu, reference.silu_mul(gate_up), **tolerance)
    for row in (0, 17, rows - 1):
        one = slice(row, row + 1)
        assert torch.equal(ops.rms_norm(x[:, one].contiguous(), weight, 1e-5)[0, 0], norm[0, row])
        alone = ops.rotary(q[:, :, one], k[:, :, one], cos[:, one], sin[:, one])
        assert torch.equal(alone[0][0, :, 0], rotated[0][0, :, row]) and torch.equal(alone[1][0, :, 0],
                                                                                     rotated[1][0, :, row])
        assert torch.equal(ops.silu_mul(gate_up[:, one].contiguous())[0, 0], silu[0, row])
    # a batch of three sequences reading one shared table (batch stride 0) and each its own
    batched = qkv.repeat(3, 1, 1)
    bq = batched[..., : heads * dim].view(3, rows, heads, dim).transpose(1, 2)
    bk = batched[..., heads * dim : (heads + kv_heads) * dim].view(3, rows, kv_heads, dim).transpose(1, 2)
    for tables in ((cos, sin), (cos.repeat(3, 1, 1), sin.repeat(3, 1, 1))):
        for got, one_sequence in zip(ops.rotary(bq, bk, *tables), rotated):
            assert all(torch.equal(got[index], one_sequence[0]) for index in range(3))
