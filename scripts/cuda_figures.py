"""GPU figures that need no downloaded weights: verification cost curves and plain-decoding speed of randomly
initialised models shaped like SmolLM2-135M and Qwen2.5-1.5B, on the CUDA-graph runtime and on the eager one, and
batch invariance (does a row's logits depend on the bucket it is verified in?) for any model given with --model.

    python scripts/cuda_figures.py --out figures.json [--model PATH_OR_GGUF] [--repeats 20]
    python scripts/cuda_figures.py --out probe.json --probe   # only: where bfloat16 rows depend on the row count

Random weights give the same cost as real ones (the same shapes and kernels), not meaningful text: acceptance and
speedups of drafting methods come from `hierspec bench` on real weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from hierspec.calibration import measure_cost_curve
from hierspec.config import GenerationConfig, ModelConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.runtime import RuntimeConfig
from hierspec.target import TargetModel, load_model
from hierspec.tree import build_tree

SHAPES = {
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=0),
    "qwen2.5-1.5b": Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                                rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
                                eos_token_id=0),
}
SIZES = (1, 2, 4, 8, 16, 32, 64)


def _tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab={"w0": 0, "w1": 1}, unk_token="w0"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w0")


def random_target(shape: str, dtype: torch.dtype, runtime: str) -> TargetModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(SHAPES[shape], dtype=dtype).to("cuda").eval()
    return TargetModel(model, _tokenizer(), shape, RuntimeConfig(kind=runtime))


def plain_tokens_per_s(target: TargetModel, tokens: int = 128, runs: int = 3) -> float:
    """Plain decoding speed (prefill of a 64-token prompt included), median of ``runs``."""
    prompt = np.random.default_rng(1).integers(2, 1000, size=64).tolist()
    decoder = SpeculativeDecoder(target, NoDrafter())
    config = GenerationConfig(max_new_tokens=tokens, stop_at_eos=False)
    decoder.generate(prompt, config)  # warm-up: captures the graphs
    return statistics.median(decoder.generate(prompt, config).stats.tokens_per_s for _ in range(runs))


def bucket_invariance(target: TargetModel, prompt: list[int], chain: list[int]) -> dict:
    """One chain verified padded to every bucket that holds it, against the smallest: the largest logit difference
    and whether every row's argmax agrees."""
    tree = build_tree(prompt[-1], [chain])
    saved = target.runtime.buckets
    rows = {}
    try:
        for bucket in [b for b in SIZES if b >= tree.size]:
            target.runtime.buckets = (bucket,)
            cache = target.new_cache(len(prompt) + 64)
            target.prefill(cache, prompt[:-1])
            rows[bucket] = target.forward_tree(cache, tree).logits.float().cpu()
    finally:
        target.runtime.buckets = saved
    first = rows[min(rows)]
    return {str(b): {"max_abs_diff": float((r - first).abs().max()),
                     "argmax_equal": bool(torch.equal(r.argmax(-1), first.argmax(-1)))} for b, r in rows.items()}


def chain_against_steps(target: TargetModel, prompt: list[int], chain: list[int]) -> dict:
    """A chain's logits verified in one forward against the same tokens fed one plain step at a time."""
    together = chain_logits(target, prompt, chain)
    steps = chain_logits(target, prompt, chain, one_by_one=True)
    return {"max_abs_diff": float((together - steps).abs().max()),
            "argmax_equal": bool(torch.equal(together.argmax(-1), steps.argmax(-1)))}


def padding_probe(dtype: torch.dtype, runtime: str, min_rows: int | None) -> dict:
    """Chains of every length verified in one forward of a random SmolLM2-shaped model against the same tokens
    decoded one forward at a time, with every forward padded to at least ``min_rows`` rows (``None``: the runtime's
    buckets): the largest logit difference per chain length (rows = length + 1)."""
    target = random_target("smollm2-135m", dtype, runtime)
    if min_rows is not None:
        target.runtime.buckets = tuple(b for b in SIZES if b >= min_rows)
    rng = np.random.default_rng(3)
    prompt, chain = rng.integers(2, 40000, size=300).tolist(), rng.integers(2, 40000, size=63).tolist()
    steps = chain_logits(target, prompt, chain, one_by_one=True)
    return {str(length + 1): float((chain_logits(target, prompt, chain[:length]) - steps[: length + 1]).abs().max())
            for length in (1, 2, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63)}


def chain_logits(target: TargetModel, prompt: list[int], chain: list[int], one_by_one: bool = False) -> torch.Tensor:
    """The logits of ``prompt[-1]`` and ``chain`` after ``prompt[:-1]``: one forward, or one forward a token."""
    cache = target.new_cache(len(prompt) + 80)
    target.prefill(cache, prompt[:-1])
    if not one_by_one:
        return target.forward_tree(cache, build_tree(prompt[-1], [chain])).logits.float().cpu()
    rows = []
    for token in [prompt[-1], *chain]:
        past = cache.get_seq_length()
        rows.append(target.forward_tree(cache, build_tree(token, [])).logits.float().cpu()[0])
        target.keep_path(cache, past, [0])
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="a real model for the batch-invariance figures")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--probe", action="store_true", help="only the padding probe (padding_probe)")
    args = parser.parse_args()
    if args.probe:
        probe = {f"{str(dtype).removeprefix('torch.')} {runtime} min {rows}": padding_probe(dtype, runtime, rows)
                 for dtype, runtime, rows in [(torch.bfloat16, "graphs", 1), (torch.bfloat16, "graphs", 2),
                                              (torch.bfloat16, "graphs", 8), (torch.bfloat16, "graphs", 16),
                                              (torch.bfloat16, "graphs", None), (torch.bfloat16, "eager", None),
                                              (torch.float32, "graphs", None)]}
        print(json.dumps(probe, indent=1))
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "probe": probe}, handle)
        return
    figures: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "curves": {}, "ar": {},
                     "invariance": {}}
    for shape in filter(None, args.shapes.split(",")):
        for dtype in (torch.bfloat16, torch.float32):
            for runtime in ("graphs", "eager"):
                key = f"{shape} {str(dtype).removeprefix('torch.')} {runtime}"
                start = time.perf_counter()
                target = random_target(shape, dtype, runtime)
                curve = measure_cost_curve(target, SIZES, context=128, repeats=args.repeats)
                figures["curves"][key] = dict(zip(map(str, curve.sizes), curve.ms))
                figures["ar"][key] = plain_tokens_per_s(target)
                print(f"{key:<32} " + " ".join(f"{ms:7.2f}" for ms in curve.ms)
                      + f"  | ar {figures['ar'][key]:7.1f} tok/s  ({time.perf_counter() - start:.0f} s)", flush=True)
                del target
                torch.cuda.empty_cache()
    if args.model:
        for dtype in ("bfloat16", "float32"):
            target = load_model(args.model, ModelConfig(device="cuda", dtype=dtype))
            prompt = target.encode_prompt("Explain how a hash map handles collisions, with an example in Python.")
            chain = SpeculativeDecoder(target, NoDrafter()).generate(prompt, GenerationConfig(
                max_new_tokens=15)).token_ids
            figures["invariance"][dtype] = {"buckets": bucket_invariance(target, prompt, chain),
                                            "chain_vs_steps": chain_against_steps(target, prompt, chain)}
            print(dtype, json.dumps(figures["invariance"][dtype]), flush=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()
