"""Load benchmark of continuous batching: Spec-Bench questions as requests, ``c`` generating at once.

    python scripts/batch_bench.py --concurrency 1,4,8,16 --methods ar,hd --per-category 2 --max-new-tokens 128 \
        --out bench-out/batch

For each concurrency ``c`` and method, every question is submitted at once to a :class:`hierspec.BatchScheduler`
with ``max_batch = c`` — as ``c`` clients sending their next request as soon as the last one is answered. Reported:
aggregate tokens/s, per-request latency p50/p95 (admission to last token: what a client of ``c`` concurrent clients
waits) and time to first token p50 (admission to first step, prefill included), steps, and whether every answer
equals the method's ``c = 1`` answer and ``ar``'s (greedy). Methods alternate within each concurrency level, so they
share the machine's state. The CPU and its flags head the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import hierspec
from hierspec.batching import BatchConfig, BatchScheduler
from hierspec.bench.questions import load_questions, select_questions
from hierspec.config import GenerationConfig, ModelConfig
from hierspec.gc_pauses import freeze_long_lived
from hierspec.machine import cpu_info, gpu_name
from hierspec.methods import DrafterContext, make_drafter, split_methods


def run_level(model, context, method: str, prompts: list[list[int]], concurrency: int, config: GenerationConfig,
              max_rows: int) -> dict:
    scheduler = BatchScheduler(model, lambda: make_drafter(method, context),
                               BatchConfig(max_batch=concurrency, max_rows=max_rows))
    scheduler.probe_drafter()  # stores opened and curves measured before the clock starts
    start = time.perf_counter()
    requests = [scheduler.submit(p, config) for p in prompts]
    scheduler.run()
    wall = time.perf_counter() - start
    done = [r.result for r in requests]
    latency = [(r.result.stats.total_time) for r in requests]
    first = [r.first_token_at - r.admitted_at for r in requests]
    tokens = sum(len(r.token_ids) for r in done)
    return {"method": method, "concurrency": concurrency, "requests": len(prompts), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "latency_p50_s": statistics.median(latency),
            "latency_p95_s": float(np.percentile(latency, 95)), "ttft_p50_s": statistics.median(first),
            "steps": scheduler.steps, "mean_accepted": sum(sum(r.stats.accept_lengths) for r in done) / max(
                1, sum(len(r.stats.accept_lengths) for r in done)),
            "batch_sizes": dict(sorted(scheduler.batch_sizes.items())), "outputs": [r.token_ids for r in done]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", default="data/spec_bench_dev.jsonl")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--methods", default="ar,hd")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-rows", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache", default="auto", choices=["auto", "model", "float16"])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--runtime", default="auto", choices=["auto", "int4", "packed", "graphs", "eager"],
                        help="CUDA graphs verify one request at a time: on CUDA, batching needs eager")
    parser.add_argument("--out", default="bench-out/batch")
    args = parser.parse_args()

    model = hierspec.load_model(args.model, ModelConfig(dtype=args.dtype, kv_cache=args.kv_cache, device=args.device,
                                                         runtime=args.runtime))
    context = DrafterContext(model)
    questions = select_questions(load_questions(args.questions), args.per_category, args.limit)
    prompts = [model.encode_prompt(q.turns[0], raw=q.raw) for q in questions]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    freeze_long_lived()  # no full collection walks the loaded model mid-step (gc_pauses.py)
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = split_methods(args.methods)
    rows = []
    for concurrency in levels:
        for method in methods:
            row = run_level(model, context, method, prompts, concurrency, config, args.max_rows)
            rows.append(row)
            print(f"{method:>6} c={concurrency:<3} {row['tokens_per_s']:7.2f} tok/s  p50 {row['latency_p50_s']:6.2f} s"
                  f"  p95 {row['latency_p95_s']:6.2f} s  ttft {row['ttft_p50_s']:5.2f} s  MAT "
                  f"{row['mean_accepted']:.2f}  steps {row['steps']}", flush=True)
    alone = {r["method"]: r["outputs"] for r in rows if r["concurrency"] == levels[0]}
    reference = alone.get("ar")
    for row in rows:
        row["identical_to_alone"] = sum(a == b for a, b in zip(row["outputs"], alone[row["method"]]))
        row["identical_to_ar"] = None if reference is None else sum(
            a == b for a, b in zip(row["outputs"], reference))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info().describe()
    gpu = gpu_name(model.device)
    report = {"cpu": cpu, "device": gpu or "cpu", "model": model.name,
              "runtime": model.runtime.describe(), "args": vars(args),
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    (out / "batch.json").write_text(json.dumps(report, indent=1))
    base = {r["method"]: r["tokens_per_s"] for r in rows if r["concurrency"] == levels[0]}
    where = f"device {gpu}; host CPU: {cpu}" if gpu else f"CPU: {cpu}"
    lines = [f"{where}; model {model.name}, runtime {model.runtime.kind}, KV cache "
             f"{model.runtime.describe()['kv_cache']}; {len(prompts)} dev questions, "
             f"{args.max_new_tokens} new tokens, greedy", "",
             "| method | concurrent | tokens/s | x one request | latency p50 s | p95 s | TTFT p50 s | MAT | "
             "identical to alone / to ar |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| `{row['method']}` | {row['concurrency']} | {row['tokens_per_s']:.2f} | "
                     f"{row['tokens_per_s'] / base[row['method']]:.2f}x | {row['latency_p50_s']:.2f} | "
                     f"{row['latency_p95_s']:.2f} | {row['ttft_p50_s']:.2f} | {row['mean_accepted']:.2f} | "
                     f"{row['identical_to_alone']}/{row['requests']} / {row['identical_to_ar']}/{row['requests']} |")
    (out / "batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
