"""Verification cost curves of one model under each runtime and decoder, for before/after comparisons.

    python scripts/cost_curves.py MODEL [--runtimes packed,eager] [--decoders auto,transformers] [--repeats 7]

MODEL is anything ``--model`` takes (default model: ``default``). Each combination loads the model afresh in float32
(``int4``: a GGUF file's own quantized weights)
and prints ``ms`` per verification forward of 1–32 tree tokens over a 128-token context (median of ``repeats``),
with the same function ``hierspec calibrate`` uses.
"""

from __future__ import annotations

import argparse
import time

import torch

from hierspec.calibration import measure_cost_curve
from hierspec.config import ModelConfig
from hierspec.loading import gguf_source, load_pretrained
from hierspec.machine import cpu_info
from hierspec.runtime import RuntimeConfig
from hierspec.target import TargetModel

SIZES = (1, 2, 4, 8, 16, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--runtimes", default="packed,eager")
    parser.add_argument("--decoders", default="auto,transformers")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    spec = None if args.model == "default" else args.model
    print(f"{cpu_info().describe()}, {args.threads} threads; ms by tree tokens: {' '.join(map(str, SIZES))}")
    for runtime in args.runtimes.split(","):
        for decoder in args.decoders.split(","):
            start = time.perf_counter()
            model, tokenizer, name, _, _ = load_pretrained(ModelConfig(spec=spec, dtype="float32",
                                                                       threads=args.threads))
            gguf = gguf_source(ModelConfig(spec=spec)) if runtime == "int4" else None
            target = TargetModel(model, tokenizer, name, RuntimeConfig(
                kind=runtime, decoder=decoder, gguf=None if gguf is None else str(gguf),
                gguf_cache=model.config._name_or_path))
            curve = measure_cost_curve(target, SIZES, context=128, repeats=args.repeats)
            print(f"{runtime:>7} {target.runtime.describe()['decoder']:>12}: "
                  + " ".join(f"{ms:7.1f}" for ms in curve.ms) + f"   ({time.perf_counter() - start:.0f} s)", flush=True)
            del target, model
            torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
