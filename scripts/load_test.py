"""Bounded load test of a running `hierspec serve`: N concurrent clients, a fixed number of requests each.

    hierspec serve --port 8000 &
    python scripts/load_test.py --url http://127.0.0.1:8000/v1 --clients 16 --requests 2 --max-tokens 32

Checks every answer is complete and well formed; prints throughput and p50/p99 latency (and time to first token
with --stream).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

import numpy as np
import openai

PROMPTS = ["Name three planets.", "What is the capital of France?", "Write one sentence about the sea.",
           "Give two synonyms for happy.", "What is 12 times 12?", "Describe a cat in one sentence.",
           "List three colors.", "What does a CPU do?"]


def one_client(url: str, model: str, index: int, requests: int, max_tokens: int, stream: bool) -> list[dict]:
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
    out = []
    for j in range(requests):
        prompt = PROMPTS[(index + j) % len(PROMPTS)]
        start = time.perf_counter()
        first = None
        if stream:
            text, finish = "", None
            for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                        max_tokens=max_tokens, temperature=0, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter() - start
                    text += chunk.choices[0].delta.content
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            tokens = None
        else:
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=max_tokens, temperature=0)
            text, finish, tokens = reply.choices[0].message.content, reply.choices[0].finish_reason, \
                reply.usage.completion_tokens
        assert text and finish in {"stop", "length"}, (text, finish)
        out.append({"latency": time.perf_counter() - start, "ttft": first, "tokens": tokens})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        results = [r for rs in pool.map(lambda i: one_client(args.url, args.model, i, args.requests, args.max_tokens,
                                                              args.stream), range(args.clients)) for r in rs]
    wall = time.perf_counter() - start
    latencies = [r["latency"] for r in results]
    line = (f"{len(results)} requests from {args.clients} clients in {wall:.1f} s: {len(results) / wall:.2f} requests/s"
            f"; latency p50 {statistics.median(latencies):.2f} s, p99 {np.percentile(latencies, 99):.2f} s")
    tokens = [r["tokens"] for r in results if r["tokens"] is not None]
    if tokens:
        line += f"; {sum(tokens) / wall:.1f} generated tokens/s"
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    if ttft:
        line += f"; time to first token p50 {statistics.median(ttft):.2f} s"
    print(line)


if __name__ == "__main__":
    main()
