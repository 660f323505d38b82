"""Greedy generation for many prompts at once, for building model stores from thousands of prompts.

One prompt at a time, a 2-core CPU spends a whole forward's weight traffic on one token; a batch of prompts shares
it. The prompts go through the serving scheduler (:class:`~hierspec.batching.BatchScheduler`, plain decoding): up
to ``batch_size`` generations share each forward of the runtime, and a prompt joins as soon as another's answer
ends — no padding, no batch waiting for its longest answer. Each answer is the one plain decoding gives that prompt
alone on this runtime, token for token (``tests/test_batching.py``): the very tokens a speculative decoder of this
model verifies against, so a model store holds what the model really says. (Under CUDA graphs the runtime
holds one sequence per forward, so the answers come one after another, each at the graphs' speed.)

Until 2026-11-27 (thirtieth session) prompts were left-padded and answered a batch at a time by the model's own
transformers modules: on the int4 path those compute in float32 from expanded weights, 2.3x (SmolLM2-135M, 2,000
ShareGPT prompts) to ~7x (Qwen2.5-Coder-1.5B) slower than this on two cores (BENCHMARKS.md, "Thirtieth session").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from hierspec.batching import BatchConfig, BatchScheduler
from hierspec.config import GenerationConfig
from hierspec.drafters.base import NoDrafter
from hierspec.target import TargetModel


def generate_greedy_batches(target: TargetModel, prompts: Sequence[list[int]], max_new_tokens: int,
                            batch_size: int = 16) -> Iterator[tuple[int, list[int]]]:
    """Yield ``(prompt index, answer token ids)`` for every prompt, each as soon as its answer ends, at most
    ``batch_size`` generating at once.

    An answer ends after its first end-of-sequence token (included) or after ``max_new_tokens`` tokens (fewer when
    the prompt leaves less room in the context; none for a prompt that fills it). A failed forward raises its error.
    """
    scheduler = BatchScheduler(target, NoDrafter, BatchConfig(max_batch=batch_size))
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    index_of: dict[int, int] = {}
    for index, prompt in enumerate(prompts):
        if len(prompt) >= target.max_context:
            yield index, []
            continue
        index_of[scheduler.submit(prompt, config).id] = index
    while not scheduler.idle:
        for request in scheduler.step():
            if request.error is not None:
                raise request.error
            if request.result is not None:
                yield index_of[request.id], list(request.result.token_ids)
