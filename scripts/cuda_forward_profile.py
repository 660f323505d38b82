"""Where a graphed one-token verification forward's time goes on CUDA: host work against GPU kernels.

    python scripts/cuda_forward_profile.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--tokens 1] [--forwards 20]
    python scripts/cuda_forward_profile.py --shape qwen2.5-1.5b     # random weights of that shape (bfloat16)

Prefills 128 tokens, then runs ``--forwards`` forwards of a chain of ``--tokens`` tokens (as ``hierspec
calibrate`` times them: each forward's entries dropped again) under ``torch.profiler`` with CPU and CUDA
activity, and prints the wall time a forward, the GPU kernels' total a forward and the top operations by host
time and by GPU time.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from hierspec.calibration import prefilled_cache
from hierspec.config import ModelConfig
from hierspec.runtime import RuntimeConfig
from hierspec.target import TargetModel, load_model
from hierspec.tree import build_tree

#: model shapes built with random weights (no file to carry): transformers config class and arguments
SHAPES = {
    "smollm2-135m": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                         rope_theta=100000.0, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                         rope_theta=1000000.0, tie_word_embeddings=True)),
}


def random_target(shape: str, runtime: RuntimeConfig) -> TargetModel:
    """A bfloat16 model of ``shape`` with random weights on CUDA, with a word-level tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    name, arguments = SHAPES[shape]
    config = getattr(transformers, name)(max_position_embeddings=8192, eos_token_id=0, **arguments)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(64)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w0")
    return TargetModel(model, tokenizer, shape, runtime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights of this shape")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--decoder", choices=["auto", "transformers"], default="auto",
                        help="transformers: the stock modules, without hierspec's fused layers")
    parser.add_argument("--forwards", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if args.shape:
        target = random_target(args.shape, RuntimeConfig(decoder=args.decoder))
    else:
        if args.decoder != "auto":
            parser.error("--decoder applies to --shape models")
        target = load_model(args.model, ModelConfig(device="cuda"))
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 10000, size=128).tolist()
    cache, past = prefilled_cache(target, ids, 1024)
    tree = build_tree(ids[-1], [rng.integers(100, 10000, size=args.tokens - 1).tolist()] if args.tokens > 1 else [])

    def forward() -> None:
        target.forward_tree(cache, tree)
        target.keep_path(cache, past, [0])
        cache.crop(-1)

    for _ in range(5):
        forward()
    target.synchronize()
    start = time.perf_counter()
    for _ in range(args.forwards):
        forward()
    target.synchronize()
    print(f"decoder: {target.runtime.decoder_name}")
    print(f"wall {1000 * (time.perf_counter() - start) / args.forwards:.3f} ms a forward (not profiled)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.forwards):
            forward()
        target.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels) / args.forwards
    count = sum(e.count for e in kernels) / args.forwards
    print(f"GPU kernels: {count:.0f} a forward, {gpu_us:.1f} us of GPU time a forward")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
