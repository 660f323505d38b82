"""The int4 path's product kernels, and its compiled layer halves, measured on this machine.

    python scripts/int4_kernels.py products      # each kernel on one SmolLM2 forward's weight shapes, shape by shape
    python scripts/int4_kernels.py forward [--model M] [--rounds 7]   # a real file's projections, in forward order
    python scripts/int4_kernels.py curves [--model M] [--rounds 3]    # whole verification forwards per kernel
    python scripts/int4_kernels.py halves [--model M] [--int4-kernel torch] [--rounds 4]
    python scripts/int4_kernels.py attention [--model M] [--int4-kernel amx] [--rounds 4]
    python scripts/int4_kernels.py agreement [--model M] [--per-category 2] [--tokens 96]

``products`` times every kernel that runs here (PyTorch's, hierspec's compiled one, the AMX one) on the shapes of
one SmolLM2-135M forward (30 layers' q/k/v, output, gate/up and down products and the two-pass Q8_0 head) at 1–16
rows, each shape alone (median of many calls: its weights stay in cache), and prints their sum per forward.
``forward`` loads the model once per kernel and times all its projections in the order of a forward (the weights
stream from memory as they do in decoding), kernels interleaved. ``curves`` measures each kernel's verification cost
curve (1–32 tokens), interleaved over ``--rounds``. Run it with ``ATEN_CPU_CAPABILITY=avx2`` to time PyTorch's AVX2
kernels; the compiled kernels then still use this CPU's widest instructions unless ``--march`` names another
instruction set for hierspec's extension (``--march znver3``: the AVX2 builds a Zen 3 runs, measured on this CPU; the
build goes into its own cache directory). ``halves`` loads the model twice — one decoder with its compiled layer
halves, one running operation by operation — and prints both verification cost curves, interleaved over
``--rounds``.
``attention`` loads the model twice — one decoder running each layer as one compiled call with its exact attention
(``int4_attention.cpp``), one running the layer halves around the numba kernel — and prints both curves.
``agreement`` measures what each kernel's rounding does to the model: the compiled kernel (float32 rows, the file's
model up to the order of its sums) decodes each dev question greedily; every kernel then reads the same tokens in
32-token chains, and each position's next-token choice and distribution are compared with the compiled kernel's
(top-1 agreement, mean KL divergence, positions whose top two the reference separates by over 1 logit).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from hierspec.calibration import measure_cost_curve
from hierspec.config import ModelConfig
from hierspec.machine import cpu_info
from hierspec.runtime import int4_kernel
from hierspec.runtime import quantized as q
from hierspec.target import load_model
from hierspec.tree import build_tree

ROWS = (1, 2, 4, 8, 16)
#: the dev questions (``agreement``)
DEV_QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "spec_bench_dev.jsonl"
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


def _kernels() -> list[str]:
    """The kernels that run here."""
    return [name for name in int4_kernel.KERNEL_CHOICES if name != "auto" and q.resolve_kernel(name)[0] is not None]


def products() -> None:
    totals = {kernel: [0.0] * len(ROWS) for kernel in _kernels()}
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
            cells.append(f"{rows}: " + "/".join(f"{times[kernel] * 1e6:.0f}" for kernel in totals))
        print(f"{name:8s} µs {'/'.join(totals)}  " + "  ".join(cells))
    print("per forward, ms at " + "/".join(map(str, ROWS)) + " rows:")
    for kernel, sums in totals.items():
        print(f"  {kernel:8s} " + " / ".join(f"{s * 1e3:.2f}" for s in sums))


def _projections(decoder) -> list[tuple[object, int]]:
    """Every projection of one forward with its input width, in forward order."""
    width = decoder.embedding.shape[1]
    order = []
    for layer in decoder.layers:
        order += [(layer.qkv, width), (layer.out, decoder.heads * decoder.head_dim), (layer.gate_up, width),
                  (layer.down, layer.gate_up.widths[0])]
    return order + [(decoder.lm_head, width)]


def forward(model: str | None, rounds: int) -> None:
    decoders = {kernel: load_model(config=ModelConfig(spec=model, threads=torch.get_num_threads(), int4_kernel=kernel)
                                   ).runtime.decoder for kernel in _kernels()}
    print("one forward's products, ms at " + "/".join(map(str, ROWS)) + " rows:")
    results = {kernel: [] for kernel in decoders}
    with torch.inference_mode():
        for rows in ROWS:
            plans = {kernel: [(p, torch.randn(rows, width)) for p, width in _projections(d)]
                     for kernel, d in decoders.items()}
            samples = {kernel: [] for kernel in decoders}
            for _ in range(rounds):
                for kernel, plan in plans.items():
                    start = time.perf_counter()
                    for projection, x in plan:
                        projection(x)
                    samples[kernel].append(time.perf_counter() - start)
            for kernel in decoders:
                results[kernel].append(statistics.median(samples[kernel]))
    for kernel, times in results.items():
        print(f"  {kernel:8s} " + " / ".join(f"{t * 1e3:.2f}" for t in times))


def curves(model: str | None, rounds: int) -> None:
    sizes = ROWS + (32,)
    targets = {kernel: load_model(config=ModelConfig(spec=model, threads=torch.get_num_threads(), int4_kernel=kernel))
               for kernel in _kernels()}
    _print_curves(targets, sizes, rounds)


def _print_curves(targets: dict, sizes: tuple[int, ...], rounds: int) -> None:
    """Each target's verification cost curve, measured interleaved over ``rounds``, medians printed."""
    measured = {name: [] for name in targets}
    for _ in range(rounds):
        for name, target in targets.items():
            measured[name].append(measure_cost_curve(target, sizes, repeats=5, desc=name))
    for name in targets:
        medians = [statistics.median(c.ms[i] for c in measured[name]) for i in range(len(sizes))]
        print(f"{name:8s} ms at {'/'.join(map(str, sizes))} tokens: " + " / ".join(f"{m:.2f}" for m in medians))


def halves(model: str | None, kernel: str, rounds: int) -> None:
    arms = {name: load_model(config=ModelConfig(spec=model, threads=torch.get_num_threads(), int4_kernel=kernel))
            for name in ("fused", "unfused")}
    if arms["fused"].runtime.decoder is None or arms["fused"].runtime.decoder._fused is None:
        raise SystemExit("this model does not run the int4 path with the compiled layer halves here")
    arms["unfused"].runtime.decoder._fused = None
    _print_curves(arms, ROWS, rounds)


def attention(model: str | None, kernel: str, rounds: int) -> None:
    """Each int4 layer as one compiled call with its exact attention (``int4_attention.cpp``) against the layer
    halves around the numba kernel (``exact_attention.py``)."""
    arms = {name: load_model(config=ModelConfig(spec=model, threads=torch.get_num_threads(), int4_kernel=kernel))
            for name in ("compiled", "numba")}
    fused = arms["numba"].runtime.decoder and arms["numba"].runtime.decoder._fused
    if not fused or not fused.attends:
        raise SystemExit("this model does not run the int4 path with compiled exact attention here")
    fused.attends = False
    _print_curves(arms, ROWS + (32,), rounds)


def agreement(model: str | None, per_category: int, tokens: int) -> None:
    from hierspec.bench.questions import load_questions, select_questions

    kernels = _kernels()
    if "compiled" not in kernels:
        raise SystemExit("the compiled kernel (the float32 reference) does not run here")
    targets = {kernel: load_model(config=ModelConfig(spec=model, threads=torch.get_num_threads(), int4_kernel=kernel))
               for kernel in ["compiled"] + [k for k in kernels if k != "compiled"]}
    reference = targets["compiled"]
    questions = select_questions(load_questions(DEV_QUESTIONS), per_category=per_category)
    logits = {kernel: [] for kernel in targets}
    with torch.inference_mode():
        for question in questions:
            prompt = reference.encode_prompt(question.turns[0])
            sequence = _greedy(reference, prompt, tokens)
            for kernel, target in targets.items():
                logits[kernel].append(_chained_logits(target, prompt, sequence))
    expected = torch.cat(logits["compiled"])
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1.0
    print(f"{len(questions)} dev questions, {expected.shape[0]} positions ({int(clear.sum())} with a top-1 margin "
          f"over 1 logit), against the compiled kernel's float32 rows")
    for kernel in targets:
        if kernel == "compiled":
            continue
        got = torch.cat(logits[kernel])
        same = got.argmax(-1) == expected.argmax(-1)
        kl = torch.nn.functional.kl_div(got.log_softmax(-1), expected.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1)
        print(f"  {kernel:8s} top-1 agreement {same.float().mean().item() * 100:.2f} % "
              f"(margin > 1: {same[clear].float().mean().item() * 100:.2f} %), mean KL {kl.mean().item():.2e}")


def _greedy(target, prompt: list[int], tokens: int) -> list[int]:
    """``prompt`` followed by the target's greedy continuation of ``tokens`` tokens, one forward a token."""
    cache = target.new_cache()
    target.prefill(cache, prompt[:-1])
    sequence = list(prompt)
    for _ in range(tokens):
        out = target.forward_tree(cache, build_tree(sequence[-1], []))
        target.keep_path(cache, len(sequence) - 1, [0])
        sequence.append(int(out.logits[0].argmax()))
    return sequence


def _chained_logits(target, prompt: list[int], sequence: list[int], chain: int = 32) -> torch.Tensor:
    """The target's float32 logits at every position of ``sequence`` after ``prompt``, read in chains of ``chain``
    tokens (as a tree of one branch is verified)."""
    cache = target.new_cache()
    target.prefill(cache, prompt[:-1])
    rows, start = [], len(prompt) - 1
    while start < len(sequence) - 1:
        part = sequence[start:start + chain]
        out = target.forward_tree(cache, build_tree(part[0], [part[1:]] if len(part) > 1 else []))
        target.keep_path(cache, start, list(range(len(part))))
        rows.append(out.logits[:len(part)].float())
        start += len(part)
    return torch.cat(rows)[:len(sequence) - len(prompt)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["products", "forward", "curves", "halves", "attention", "agreement"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--int4-kernel", default="torch",
                        choices=[k for k in int4_kernel.KERNEL_CHOICES if k != "auto"])
    parser.add_argument("--rounds", type=int, default=None, help="default: 7 (forward), 3 (curves), 4 (halves)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--per-category", type=int, default=2, help="agreement: dev questions per category")
    parser.add_argument("--tokens", type=int, default=96, help="agreement: tokens decoded per question")
    parser.add_argument("--march", default=None, help="build hierspec's extension for this -march (default: native)")
    args = parser.parse_args()
    if args.march:  # before anything builds the extension: its cache key covers the flags
        int4_kernel.CFLAGS = tuple(f"-march={args.march}" if flag.startswith("-march=") else flag
                                   for flag in int4_kernel.CFLAGS)
    torch.set_num_threads(args.threads)
    print(cpu_info().describe(), f"torch kernels {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    if args.what == "products":
        products()
    elif args.what == "forward":
        forward(args.model, args.rounds or 7)
    elif args.what == "curves":
        curves(args.model, args.rounds or 3)
    elif args.what == "agreement":
        agreement(args.model, args.per_category, args.tokens)
    elif args.what == "halves":
        halves(args.model, args.int4_kernel, args.rounds or 4)
    else:
        attention(args.model, args.int4_kernel, args.rounds or 4)


if __name__ == "__main__":
    main()
