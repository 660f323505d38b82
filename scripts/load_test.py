"""Bounded load test of a running `hierspec serve`: N concurrent clients, a fixed number of requests each.

    hierspec serve --port 8000 &
    python scripts/load_test.py --url http://127.0.0.1:8000/v1 --clients 16 --requests 2 --max-tokens 32
    python scripts/load_test.py --clients 16 --duration 300 --mixed     # a 5-minute soak

Checks every answer is complete and well formed and, the requests being greedy, that every answer to a prompt is the
same text (streamed or not): a lost, failed, malformed or differing answer is counted, and the exit status is 1 if
any was. Prints throughput and p50/p99 latency (and time to first token when streaming). ``--duration`` keeps each
client sending until that many seconds have passed; ``--mixed`` makes every other request a streamed one.
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


def one_request(client, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    """One chat completion; its text, finish reason, token count (plain requests), latency and time to first
    token (streamed ones)."""
    start = time.perf_counter()
    first, tokens = None, None
    if stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=max_tokens, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                text += chunk.choices[0].delta.content
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    else:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0)
        text, finish, tokens = reply.choices[0].message.content, reply.choices[0].finish_reason, \
            reply.usage.completion_tokens
    return {"prompt": prompt, "text": text, "finish": finish, "tokens": tokens,
            "latency": time.perf_counter() - start, "ttft": first}


def one_client(url: str, model: str, index: int, requests: int, max_tokens: int, stream: bool, deadline: float | None,
               mixed: bool) -> list[dict]:
    """A client's requests in turn (``requests`` of them, or until ``deadline``); a failed request is recorded with
    its error instead of ending the client."""
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
    out = []
    j = 0
    while (time.perf_counter() < deadline) if deadline is not None else j < requests:
        prompt = PROMPTS[(index + j) % len(PROMPTS)]
        streamed = stream or (mixed and (index + j) % 2 == 1)
        try:
            out.append(one_request(client, model, prompt, max_tokens, streamed))
        except Exception as exc:  # counted, not raised: the soak reports every loss
            out.append({"prompt": prompt, "error": f"{type(exc).__name__}: {exc}"})
        j += 1
    return out


def problems(results: list[dict]) -> list[str]:
    """What is wrong with the answers: errors, incomplete or malformed answers, and answers to one prompt that
    differ from its first answer (greedy requests must all agree)."""
    found, first = [], {}
    for r in results:
        if "error" in r:
            found.append(f"{r['prompt']!r}: {r['error']}")
        elif not r["text"] or r["finish"] not in {"stop", "length"}:
            found.append(f"{r['prompt']!r}: malformed answer (finish {r['finish']!r}, {len(r['text'] or '')} chars)")
        elif first.setdefault(r["prompt"], r["text"]) != r["text"]:
            found.append(f"{r['prompt']!r}: answer differs from its first answer")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--duration", type=float, default=None, help="seconds each client keeps sending")
    parser.add_argument("--mixed", action="store_true", help="every other request streamed")
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = None if args.duration is None else start + args.duration
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        results = [r for rs in pool.map(lambda i: one_client(args.url, args.model, i, args.requests, args.max_tokens,
                                                              args.stream, deadline, args.mixed),
                                        range(args.clients)) for r in rs]
    wall = time.perf_counter() - start
    answered = [r for r in results if "error" not in r]
    latencies = [r["latency"] for r in answered] or [float("nan")]
    line = (f"{len(results)} requests from {args.clients} clients in {wall:.1f} s: {len(results) / wall:.2f} requests/s"
            f"; latency p50 {statistics.median(latencies):.2f} s, p99 {np.percentile(latencies, 99):.2f} s")
    tokens = [r["tokens"] for r in answered if r["tokens"] is not None]
    if tokens:
        line += f"; {sum(tokens) / wall:.1f} generated tokens/s (plain requests)"
    ttft = [r["ttft"] for r in answered if r["ttft"] is not None]
    if ttft:
        line += f"; time to first token p50 {statistics.median(ttft):.2f} s ({len(ttft)} streamed)"
    print(line)
    found = problems(results)
    print(f"{len(found)} of {len(results)} requests lost, failed, malformed or differing")
    for problem in found[:20]:
        print("  " + problem)
    raise SystemExit(1 if found else 0)


if __name__ == "__main__":
    main()
