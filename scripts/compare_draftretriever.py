"""Suffix store vs REST's DraftRetriever on the same tokens and the same queries.

Usage:
    python scripts/compare_draftretriever.py --store DIR --answers bench-out/core/answers-ar.jsonl --out FILE.json

Measures for both: build time from the same token ids (indexing only; tokenization is reported with the store),
size on disk, peak RSS while building, RSS after load, query latency p50/p99. Queries are contexts taken from
real generations (every 4th position of each answer, the prompt-free last 16 tokens). Each side runs in its own
process so that RSS is its own. hierspec's query is the whole REST drafting step (longest match, continuations,
trie top-c, draft tree); DraftRetriever's is its `search` loop from 16 tokens down to 2, as REST's code calls it.
``draftretriever`` is a measurement dependency only (pip install draftretriever).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import numpy as np

K, CHOICES, LONG, N_MAX, N_MIN = 5000, 64, 10, 16, 2


def rss_mb() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def percentiles(times: list[float]) -> dict:
    ms = np.array(times) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "queries": len(times)}


def load_queries(answers: Path, tokenizer_dir: str, limit: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    queries = []
    for line in answers.read_text().splitlines():
        text = json.loads(line)["choices"][0]["turns"][0]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        queries += [ids[max(0, p - N_MAX):p] for p in range(N_MIN, len(ids), 4)]
    return queries[:limit]


def run_hierspec(store_dir: str, queries: list[list[int]], result: dict) -> None:
    from hierspec.datastore.suffix import SuffixStore
    from hierspec.drafters.rest import RestConfig, RestDrafter

    before = rss_mb()
    store = SuffixStore.open(store_dir)
    drafter = RestDrafter(store, RestConfig(n_max=N_MAX, n_min=N_MIN, k=K, m=LONG, c=CHOICES))
    drafter.propose(np.array(queries[0]), CHOICES)  # numba kernels compile or load from cache
    loaded = rss_mb()
    match_times, step_times, drafted = [], [], 0
    for q in queries:
        ctx = np.array(q, dtype=np.int64)
        t0 = time.perf_counter()
        store.longest_match(ctx, N_MAX, N_MIN)
        t1 = time.perf_counter()
        tree = drafter.propose(ctx, CHOICES)
        t2 = time.perf_counter()
        match_times.append(t1 - t0)
        step_times.append(t2 - t1)
        drafted += tree.num_drafted
    result.update(rss_before_mb=before, rss_after_load_mb=loaded, rss_after_queries_mb=rss_mb(),
                  match=percentiles(match_times), draft_step=percentiles(step_times),
                  mean_draft_tokens=drafted / len(queries))


def run_draftretriever(index_file: str, queries: list[list[int]], result: dict) -> None:
    import draftretriever

    before = rss_mb()
    t0 = time.perf_counter()
    reader = draftretriever.Reader(index_file_path=index_file)
    load_time = time.perf_counter() - t0
    loaded = rss_mb()
    times, drafted = [], 0
    for q in queries:
        t0 = time.perf_counter()
        for n in range(min(N_MAX, len(q)), N_MIN - 1, -1):
            out = reader.search(q[-n:], k=K, choices=CHOICES, long=LONG)
            if out[0]:
                drafted += len(out[0])
                break
        times.append(time.perf_counter() - t0)
    result.update(rss_before_mb=before, rss_after_load_mb=loaded, rss_after_queries_mb=rss_mb(),
                  load_seconds=load_time, draft_step=percentiles(times), mean_draft_tokens=drafted / len(queries))


def build_draftretriever(store_dir: str, index_file: str, vocab_size: int, result: dict) -> None:
    import draftretriever

    from hierspec.datastore.suffix import SuffixStore

    store = SuffixStore.open(store_dir)
    t0 = time.perf_counter()
    writer = draftretriever.Writer(file_path=index_file, vocab_size=vocab_size)
    for tokens, _ in store.shards:
        bounds = np.flatnonzero(np.asarray(tokens) == store.separator)
        start = 0
        for end in bounds:
            if end > start:
                writer.add_entry(np.asarray(tokens[start:end]).tolist())
            start = end + 1
    writer.finalize()
    result.update(build_seconds=time.perf_counter() - t0, bytes_on_disk=os.path.getsize(index_file),
                  peak_rss_mb=peak_rss_mb())


def index_hierspec(store_dir: str, out_dir: str, result: dict) -> None:
    """hierspec's indexing alone (suffix array + writing), from the same tokens DraftRetriever is given."""
    from hierspec.datastore.format import write_array
    from hierspec.datastore.suffix import SuffixStore, suffix_array

    store = SuffixStore.open(store_dir)
    t0 = time.perf_counter()
    size = 0
    for index, (tokens, _) in enumerate(store.shards):
        tokens = np.array(tokens)
        sa = suffix_array(tokens)
        write_array(Path(out_dir), f"t{index}", tokens)
        write_array(Path(out_dir), f"s{index}", sa)
        size += tokens.nbytes + sa.nbytes
    result.update(build_seconds=time.perf_counter() - t0, bytes_on_disk=size, peak_rss_mb=peak_rss_mb())


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def in_process(target, *args) -> dict:
    with mp.Manager() as manager:
        shared = manager.dict()
        proc = mp.get_context("spawn").Process(target=target, args=(*args, shared))
        proc.start()
        proc.join()
        return dict(shared)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--answers", required=True, help="Spec-Bench answers jsonl whose texts give the contexts")
    parser.add_argument("--tokenizer-dir", required=True, help="directory of the store's tokenizer")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from hierspec.datastore.suffix import SuffixStore

    store = SuffixStore.open(args.store)
    header = store.info()
    queries = load_queries(Path(args.answers), args.tokenizer_dir, args.queries)
    report = {"store": {k: header[k] for k in ("num_tokens", "num_documents", "build_seconds", "bytes_on_disk",
                                               "bytes_per_token")},
              "queries": len(queries), "settings": {"k": K, "choices": CHOICES, "long": LONG, "n_max": N_MAX}}
    report["hierspec"] = in_process(run_hierspec, args.store, queries)
    with tempfile.TemporaryDirectory() as tmp:
        report["hierspec_index"] = in_process(index_hierspec, args.store, tmp)
    with tempfile.TemporaryDirectory() as tmp:
        index_file = str(Path(tmp) / "draftretriever.idx")
        report["draftretriever_build"] = in_process(build_draftretriever, args.store, index_file, header["vocab_size"])
        report["draftretriever"] = in_process(run_draftretriever, index_file, queries)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
