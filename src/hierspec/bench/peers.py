"""llama.cpp as a benchmark peer: ``llamacpp-ar`` decodes the same GGUF file with llama.cpp (through its Python
binding, ``pip install 'hierspec[peers]'``, which compiles llama.cpp where no wheel exists) in the same run,
interleaved per question like every other method; ``llamacpp-pld`` does the same with the binding's own prompt-lookup
drafting (``LlamaPromptLookupDecoding``: the longest of the last 1–2 tokens' earlier matches, ``num_pred_tokens``
drafted after it — 2, the binding's advice for CPU-only machines; it does not report its forwards, so MAT is n/a).

The prompt is the very token ids hierspec feeds its own methods (the GGUF's vocabulary is the same), prefill
included in the time, llama.cpp's prefix cache emptied before every answer. Its numerics differ (its own kernels and,
for a quantized file, its quantized weights), so its outputs are reported and counted, not expected to equal ``ar``.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

from hierspec.bench.metrics import QuestionRun
from hierspec.config import GenerationConfig, ModelConfig
from hierspec.errors import InputError
from hierspec.loading import gguf_source
from hierspec.target import TargetModel

LLAMACPP_METHODS = ("llamacpp-ar", "llamacpp-pld")
#: tokens llamacpp-pld drafts after a match (llama-cpp-python's advice for CPU-only machines; 10 for GPUs)
PLD_TOKENS_CPU = 2


def gguf_file(model_config: ModelConfig | None) -> Path:
    """The GGUF file the benchmark's model came from: the default model's, a short name's (``qwen-coder-1.5b``) or
    ``--model FILE.gguf``."""
    path = gguf_source(model_config if model_config is not None else ModelConfig())
    if path is None:
        raise InputError("llamacpp-ar runs a GGUF file: pass --model FILE.gguf or a short name such as "
                         "qwen-coder-1.5b (or use the default model)")
    return path


class LlamaCppRunner:
    """Decoding by llama.cpp of the GGUF file the target was loaded from: plain, or (``label="llamacpp-pld"``)
    with its prompt-lookup drafting."""

    def __init__(self, model: TargetModel, path: Path, config: GenerationConfig, threads: int,
                 context: int = 4096, label: str = "llamacpp-ar") -> None:
        if label not in LLAMACPP_METHODS:
            raise InputError(f"unknown llama.cpp peer {label!r}: use {', '.join(LLAMACPP_METHODS)}")
        try:
            llama_cpp = importlib.import_module("llama_cpp")
        except ImportError:
            raise InputError("llamacpp-ar needs llama.cpp's Python binding: pip install 'hierspec[peers]' "
                             "(it compiles llama.cpp; a few minutes)") from None
        self.label = label
        self.model = model
        self.config = config
        drafting = {}
        if label == "llamacpp-pld":
            speculative = importlib.import_module("llama_cpp.llama_speculative")
            drafting["draft_model"] = speculative.LlamaPromptLookupDecoding(num_pred_tokens=PLD_TOKENS_CPU)
            # the binding verifies drafts from its score rows, kept for the whole context only with logits_all
            # (without it a prompt longer than n_batch fails: "could not broadcast ... into shape (0,)")
            drafting["logits_all"] = True
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, verbose=False, **drafting)
        self.eos = model.eos_token_ids

    def describe(self) -> dict:
        return {"peer": "llama.cpp", "model_path": self.llm.model_path}

    def run(self, prompt_ids: list[int], seed: int | None = None) -> QuestionRun:
        sampling = self.config.sampling
        options = {"temp": 0.0, "top_k": 1} if sampling.greedy else {
            "temp": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": 0.0}
        if not sampling.greedy:
            self.llm.set_seed(seed if seed is not None else (sampling.seed or 0))
        self.llm.reset()  # no prefix reuse from the previous answer
        tokens: list[int] = []
        start = time.perf_counter()
        for token in self.llm.generate(prompt_ids, repeat_penalty=1.0, reset=True, **options):
            tokens.append(int(token))
            if token in self.eos or len(tokens) >= self.config.max_new_tokens:
                break
        wall = time.perf_counter() - start
        steps = [1] * len(tokens) if self.label == "llamacpp-ar" else []  # the binding does not count forwards
        return QuestionRun(token_ids=tokens, text=self.model.decode(tokens), wall_time=wall, accept_lengths=steps)
