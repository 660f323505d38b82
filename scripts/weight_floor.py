"""A one-token forward against its weight-traffic floor, bandwidth and forward timed in turns (issue 33's measure).

    python scripts/weight_floor.py [--model M] [--rounds 6] [--forwards 60] [--context 128]

The floor is the bytes of weights one decoding step reads ÷ the memory bandwidth measured on this machine. Bandwidth
moves from minute to minute on a shared 2-core machine (25–41 GB/s within minutes on a Zen 4), so a floor from one
measurement and a forward timed at another say little: each round takes seven readings of a 1 GiB float32
``torch.sum`` (GB/s = bytes ÷ 1e9 ÷ seconds, median), then ``--forwards`` one-token verification forwards over
``--context`` cached tokens (median), and prints both and their ratio. The bytes are the model's GGUF tensors as
stored (codes and scales) less the token-embedding table when the file has its own output head (a step reads one row
of it); with tied embeddings the table is the head and counts whole. The model loads as ``hierspec`` loads it
(default: SmolLM2's Q4_1 file on the int4 path); the collector's long-lived objects are frozen as the bench does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from hierspec.calibration import forward_ms, prefilled_cache
from hierspec.config import ModelConfig
from hierspec.gc_pauses import freeze_long_lived
from hierspec.loading import default_model_path, gguf_source
from hierspec.machine import cpu_info
from hierspec.target import load_model
from hierspec.tree import build_tree

GIB_FLOATS = 2**28


def weight_bytes(path) -> int:
    """Bytes of the GGUF tensors one decoding step streams (see the module docstring)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def bandwidth_gbs(buffer: torch.Tensor, readings: int = 7) -> float:
    """Median GB/s of ``readings`` sums of ``buffer``."""
    rates = []
    for _ in range(readings):
        start = time.perf_counter()
        buffer.sum()
        rates.append(buffer.numel() * buffer.element_size() / 1e9 / (time.perf_counter() - start))
    return statistics.median(rates)


def one_token_ms(model, cache, past: int, root: int, forwards: int) -> float:
    """Median milliseconds of ``forwards`` one-token verification forwards over ``cache`` (``past`` entries), timed as
    ``hierspec calibrate`` times them (each one's entry dropped afterwards)."""
    tree = build_tree(root, [])
    return statistics.median(forward_ms(model, cache, past, tree) for _ in range(forwards))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="anything --model takes (default: the default model)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--forwards", type=int, default=60)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    config = ModelConfig(spec=args.model, threads=args.threads)
    source = gguf_source(config) if args.model else default_model_path()
    if source is None:
        raise SystemExit("the floor is computed from a GGUF file's tensors: pass a .gguf model (or a named one)")
    floor_bytes = weight_bytes(source)
    model = load_model(config=config)
    ids = np.random.default_rng(0).integers(0, model.vocab_size, size=args.context).tolist()
    cache, past = prefilled_cache(model, ids[:-1], args.context + 8)
    one_token_ms(model, cache, past, ids[-1], 20)  # warm-up
    freeze_long_lived()
    buffer = torch.ones(GIB_FLOATS)
    print(f"{source.name}: {floor_bytes / 1e6:.1f} MB a step; {cpu_info().describe()}, {args.threads} threads")
    ratios = []
    for round_index in range(args.rounds):
        gbs = bandwidth_gbs(buffer)
        ms = one_token_ms(model, cache, past, ids[-1], args.forwards)
        floor_ms = floor_bytes / 1e6 / gbs
        ratios.append(ms / floor_ms)
        print(f"round {round_index}: {gbs:.1f} GB/s, floor {floor_ms:.2f} ms, one token {ms:.2f} ms, "
              f"{ratios[-1]:.2f}x", flush=True)
    print(f"one token / floor: {min(ratios):.2f}-{max(ratios):.2f}x (median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
