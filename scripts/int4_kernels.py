"""The int4 path's two product kernels, and its compiled layer halves, measured on this machine.

    python scripts/int4_kernels.py products [--shapes smollm2]   # each kernel on one forward's weight shapes
    python scripts/int4_kernels.py halves [--model M] [--int4-kernel torch] [--rounds 4]

``products`` times hierspec's compiled kernel and PyTorch's on the shapes of one SmolLM2-135M forward (30 layers'
q/k/v, output, gate/up and down products and the two-pass Q8_0 head) at 1–16 rows, each shape alone (median of
many calls), and prints their sum per forward. Run it with ``ATEN_CPU_CAPABILITY=avx2`` to time PyTorch's AVX2
kernels; the compiled kernel then still uses this CPU's widest instructions (BENCHMARKS.md shows an AVX2 build of
it beside them). ``halves`` loads the model twice — one decoder with its compiled layer halves, one running
operation by operation — and prints both verification cost curves, interleaved over ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hierspec.calibration import measure_cost_curve
from hierspec.config import ModelConfig
from hierspec.machine import cpu_info
from hierspec.runtime import quantized as q
from hierspec.target import load_model

ROWS = (1, 2, 4, 8, 16)
#: one SmolLM2-135M forward: name -> (out, in, passes, calls per forward)
SMOLLM2 = {"qkv": (960, 576, 1, 30), "out": (576, 576, 1, 30), "gate_up": (3072, 576, 1, 30),
           "down": (576, 1536, 1, 30), "head": (49152, 576, 2, 1)}


def _median_seconds(call, repeats: int) -> float:
    for _ in range(5):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def products() -> None:
    totals = {kernel: [0.0] * len(ROWS) for kernel in ("compiled", "torch")}
    generator = torch.Generator().manual_seed(0)
    for name, (out_features, in_features, passes, calls) in SMOLLM2.items():
        weight = [q.Int4Weight(torch.randint(0, 16, (out_features, in_features), generator=generator,
                                             dtype=torch.uint8),
                               torch.rand(out_features, in_features // q.GROUP, generator=generator),
                               torch.rand(out_features, in_features // q.GROUP, generator=generator))
                  for _ in range(passes)]
        projections = {kernel: q.Int4Projection([weight], [None], kernel) for kernel in totals}
        cells = []
        for i, rows in enumerate(ROWS):
            x = torch.randn(rows, in_features)
            times = {kernel: _median_seconds(lambda p=p: p(x), 30 if calls == 1 else 300)
                     for kernel, p in projections.items()}
            for kernel, seconds in times.items():
                totals[kernel][i] += seconds * calls
            cells.append(f"{rows}: {times['compiled'] * 1e6:.0f}/{times['torch'] * 1e6:.0f}")
        print(f"{name:8s} µs compiled/torch  " + "  ".join(cells))
    print("per forward, ms at " + "/".join(map(str, ROWS)) + " rows:")
    for kernel, sums in totals.items():
        print(f"  {kernel:8s} " + " / ".join(f"{s * 1e3:.2f}" for s in sums))


def halves(model: str | None, kernel: str, rounds: int) -> None:
    arms = {name: load_model(config=ModelConfig(spec=model, threads=torch.get_num_threads(), int4_kernel=kernel))
            for name in ("fused", "unfused")}
    if arms["fused"].runtime.decoder is None or arms["fused"].runtime.decoder._fused is None:
        raise SystemExit("this model does not run the int4 path with the compiled layer halves here")
    arms["unfused"].runtime.decoder._fused = None
    curves = {name: [] for name in arms}
    for _ in range(rounds):
        for name, target in arms.items():
            curves[name].append(measure_cost_curve(target, ROWS, repeats=5, desc=name))
    for name in arms:
        medians = [statistics.median(c.ms[i] for c in curves[name]) for i in range(len(ROWS))]
        print(f"{name:8s} ms at {'/'.join(map(str, ROWS))} tokens: " + " / ".join(f"{m:.2f}" for m in medians))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["products", "halves"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--int4-kernel", default="torch", choices=["compiled", "torch"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_info().describe(), f"torch kernels {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    if args.what == "products":
        products()
    else:
        halves(args.model, args.int4_kernel, args.rounds)


if __name__ == "__main__":
    main()
