"""The verification runtime beneath :class:`~hierspec.target.TargetModel`: how a tree forward runs on a device.

It owns what makes a forward cheap and leaves the model's code untouched:

* :mod:`~hierspec.runtime.onednn` — on CPU in float32 or bfloat16, every ``nn.Linear`` computes with a oneDNN
  prepacked weight (the one place that uses PyTorch's private ops; eager fallback with one log line);
* :mod:`~hierspec.runtime.attention` — tree attention registered through transformers' ``AttentionInterface``,
  attending grouped-query caches in place;
* :mod:`~hierspec.runtime.kv_cache` — a KV cache in preallocated, doubling buffers, compacted in place;
* :mod:`~hierspec.runtime.inputs` — ids, positions and mask written into reused buffers, padded to a few bucket
  sizes, so a row's result does not depend on the tree around it;
* :mod:`~hierspec.runtime.quantized` — a GGUF file's 4-bit/8-bit blocks multiplied as they are (PyTorch's int4
  kernel) instead of expanded to float32;
* :mod:`~hierspec.runtime.graphs` — on CUDA, a static KV cache owned by the runtime and reused by every generation,
  and tree forwards replayed from CUDA graphs captured once per (rows, key width) shape.

Drafters and the decoding loop know none of this. BENCHMARKS.md ("Runtime") gives what each piece bought.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hierspec.errors import InputError
from hierspec.runtime import attention, cuda_attention, cuda_fusion, onednn
from hierspec.runtime import prompt_kernel as prompt_choice
from hierspec.runtime.decoder import LlamaFamilyDecoder, Segment, build_decoder
from hierspec.runtime.dense_kernel import DENSE_KERNELS, resolve_dense_kernel
from hierspec.runtime.decoder import unsupported_reason as decoder_reason
from hierspec.runtime.exact_attention import ExactPlan
from hierspec.runtime.fusion import fuse_shared_inputs
from hierspec.runtime.graphs import MIN_CAPACITY, GraphedForward, StaticTreeCache
from hierspec.runtime.inputs import TreeInputs, bucket_for
from hierspec.runtime.int4_kernel import KERNEL_CHOICES, loaded_kernel, six_bit_products
from hierspec.runtime.kv_cache import DEFAULT_CAPACITY, TreeCache, cache_argument, doubled_capacity
from hierspec.runtime.onednn import LinearPacking, probe
from hierspec.runtime.prompt_kernel import PROMPT_KERNELS, expanded_product_dtype, resolve_prompt_kernel
from hierspec.runtime.packed_store import PackedStore
from hierspec.runtime.quantized import (CACHE_FILE, REQUANTIZED_CACHE_FILE, Int4Kernels, Int4Weight,
                                        float_weights_4bit, load_gguf_weights, resolve_kernel)
from hierspec.runtime.slots import SlotPool

log = logging.getLogger(__name__)

RUNTIME_KINDS = ("auto", "int4", "packed", "graphs", "eager")
ATTENTIONS = ("auto", "sdpa", "exact")
KV_CACHE_CHOICES = ("auto", "model", "float16")
REQUANTIZE_CHOICES = ("none", "4bit")
#: tree sizes (root included) are padded up to one of these row counts on the packed CPU runtime: a bounded set of
#: shapes, never a one-row product (the one size whose float32 results differ from the others'), and 4 rows cost
#: less than 1 or 2 with oneDNN's kernels (BENCHMARKS.md, "Runtime")
PACKED_BUCKETS = (4, 6, 8, 12, 16, 24, 32, 48, 64)
#: key/value views and masks of tree forwards are this many slots wide, rounded up, on the packed and int4
#: runtimes: whole key blocks of CPU attention, so that a row's attention does not depend on the tree beside it
PACKED_KV_ALIGN = attention.KEY_BLOCK
#: entries per slot a batch's shared cache starts with (every slot grows together past it)
MIN_SLOT_CAPACITY = 512
#: row buckets of CUDA-graph tree forwards: one graph per bucket and key width, a 1-row graph for plain decoding
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: CUDA-graph buckets in bfloat16/float16: every forward, plain decoding's too, has at least 16 rows. cuBLAS multiplies
#: up to 8 rows with other kernels than 16-64 (another summation order), which moved low-precision logits of rows
#: verified in a tree away from the same rows decoded one by one; from 16 rows on they were bit-identical (a
#: SmolLM2-shaped model on an H200, every chain length 1-63; BENCHMARKS.md). Plain decoding costs ~10 % more.
INVARIANT_GRAPH_BUCKETS = (16, 32, 64)


def default_buckets(kind: str, device: torch.device, dtype: torch.dtype) -> tuple[int, ...]:
    """The row counts a runtime of ``kind`` pads trees to when none are given: :data:`PACKED_BUCKETS` when packed,
    :data:`GRAPH_BUCKETS` with graphs (:data:`INVARIANT_GRAPH_BUCKETS` on CUDA in bfloat16/float16), none else."""
    if kind == "graphs":
        low_precision = dtype in (torch.bfloat16, torch.float16)
        return INVARIANT_GRAPH_BUCKETS if device.type == "cuda" and low_precision else GRAPH_BUCKETS
    return PACKED_BUCKETS if kind == "packed" else ()


@dataclass(frozen=True)
class RuntimeConfig:
    """How verification forwards run.

    Attributes:
        kind: ``"auto"`` (CUDA graphs on CUDA; on CPU the ``gguf`` file's quantized weights where it names one and
            its blocks are supported, else prepacked oneDNN linears in float32/bfloat16 where they work; else
            eager), ``"int4"`` (the ``gguf`` file's weights, an error where that path cannot run), ``"packed"``
            (oneDNN, an error where packing is unavailable), ``"graphs"`` (a static KV cache with tree forwards
            replayed from CUDA graphs; on the CPU the same static path runs uncaptured)
            or ``"eager"`` (PyTorch's own linears and a growing cache: no second copy of the weights in memory).
        buckets: row counts a tree is padded to; ``None`` = :func:`default_buckets` (by kind, device and dtype).
        decoder: ``"auto"`` (on the CPU, hierspec's own forward for Llama-family models,
            :mod:`hierspec.runtime.decoder`, with packed or PyTorch products by ``kind``; on CUDA graphs,
            transformers' modules with fused forwards, :mod:`hierspec.runtime.cuda_fusion`) or ``"transformers"``
            (transformers' modules as they are).
        gguf: the GGUF file the model was loaded from, whose quantized blocks the ``int4`` path multiplies;
            ``None``: the loaded (dequantized) weights only.
        gguf_cache: a directory where the decoded blocks are cached (the file's converted-weights directory).
        attention: ``"auto"`` (``"exact"`` wherever hierspec's own decoder runs on the CPU and on CUDA graphs
            where Triton is installed, else ``"sdpa"``), ``"sdpa"`` (tree attention by PyTorch's SDPA: chains
            bit-exact, other branches' nodes may differ in the last bits, which flipped near-ties on a Zen 4 and in
            bfloat16 on an H200) or ``"exact"`` (every tree row bit-identical to plain decoding: on the CPU
            :mod:`~hierspec.runtime.exact_attention`, needing hierspec's own decoder; on CUDA graphs
            :mod:`~hierspec.runtime.cuda_attention`; an error elsewhere).
        int4_kernel: the int4 path's product kernel, ``"auto"``, ``"compiled"``, ``"torch"``, ``"amx"``, ``"bf16"``,
            ``"vnni"`` or ``"vnni8"`` (:func:`~hierspec.runtime.quantized.resolve_kernel`).
        kv_cache: the KV cache's storage, ``"auto"`` (float16 where the compiled layers attend exactly: the int4
            path, a bfloat16 model; a float32 model keeps float32 entries), ``"model"`` (the model's dtype) or
            ``"float16"`` (an error where the compiled layers do not run).
        requantize: ``"none"`` or ``"4bit"``: the int4 path's weights of more than 4 bits rounded to 4-bit codes at
            load (:func:`~hierspec.runtime.quantized.requantize_4bit`; draft models); a float32 model loaded without
            a GGUF file then runs the int4 path on its own weights rounded to 4 bits
            (:func:`~hierspec.runtime.quantized.float_weights_4bit`; draft models from a checkpoint).
        prompt_kernel: which products read prompts on the int4 path, ``"auto"``, ``"expanded"``, ``"vnni"`` or
            ``"vnni8"`` (:mod:`~hierspec.runtime.prompt_kernel`).
        dense_kernel: which products multiply a bfloat16 or float32 model's tree and batch rows in the compiled layers,
            ``"auto"``, ``"onednn"`` or ``"dots"`` (:mod:`~hierspec.runtime.dense_kernel`).
    """

    kind: str = "auto"
    buckets: tuple[int, ...] | None = None
    decoder: str = "auto"
    gguf: str | None = None
    gguf_cache: str | None = None
    attention: str = "auto"
    int4_kernel: str = "auto"
    kv_cache: str = "auto"
    requantize: str = "none"
    prompt_kernel: str = "auto"
    dense_kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.dense_kernel not in DENSE_KERNELS:
            raise InputError(f"unknown dense kernel {self.dense_kernel!r}: use {', '.join(DENSE_KERNELS)}")
        if self.requantize not in REQUANTIZE_CHOICES:
            raise InputError(f"unknown requantization {self.requantize!r}: use {' or '.join(REQUANTIZE_CHOICES)}")
        if self.kv_cache not in KV_CACHE_CHOICES:
            raise InputError(f"unknown KV cache dtype {self.kv_cache!r}: use {', '.join(KV_CACHE_CHOICES)}")
        if self.kind not in RUNTIME_KINDS:
            raise InputError(f"unknown runtime {self.kind!r}: use {', '.join(RUNTIME_KINDS)}")
        if self.buckets is not None and (any(b < 1 for b in self.buckets) or list(self.buckets) != sorted(
                set(self.buckets))):
            raise InputError("runtime buckets must be increasing positive row counts")
        if self.decoder not in ("auto", "transformers"):
            raise InputError(f"unknown decoder {self.decoder!r}: use auto or transformers")
        if self.int4_kernel not in KERNEL_CHOICES:
            raise InputError(f"unknown int4 kernel {self.int4_kernel!r}: use {', '.join(KERNEL_CHOICES)}")
        if self.attention not in ATTENTIONS:
            raise InputError(f"unknown attention {self.attention!r}: use {', '.join(ATTENTIONS)}")
        if self.prompt_kernel not in PROMPT_KERNELS:
            raise InputError(f"unknown prompt kernel {self.prompt_kernel!r}: use {', '.join(PROMPT_KERNELS)}")


class Runtime:
    """Forward machinery for one loaded model, chosen by device, dtype and :class:`RuntimeConfig`."""

    def __init__(self, model: torch.nn.Module, config: RuntimeConfig | None = None) -> None:
        self.model = model
        self.config = config or RuntimeConfig()
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self._stock_attention = model.config._attn_implementation
        self.fused_groups: list = []
        use_graphs = self.config.kind == "graphs" or (self.config.kind == "auto" and self.device.type == "cuda")
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and not onednn.native_bfloat16():
            _warn_emulated_bfloat16()
        self.decoder: LlamaFamilyDecoder | None = None
        #: the decoder that reads prompts where it is not :attr:`decoder` (:mod:`~hierspec.runtime.prompt_kernel`)
        self.prefill_decoder: LlamaFamilyDecoder | None = None
        self.prompt_kernel: str | None = None
        #: the kernel of a bfloat16 or float32 model's dense products in the compiled layers (``None`` off them)
        self.dense_kernel: str | None = None
        self._short_prompt_rows: int | None = None  # timed when first needed (short_prompt_rows)
        self.packing = None
        self.int4_kernel: Int4Kernels | None = None
        quantized = None if use_graphs else self._quantized_weights()
        packable = not use_graphs and quantized is None and self._packing_reason() is None
        if quantized is not None:
            packs = self._packed_store()
            self.decoder = build_decoder(model, packed=False, quantized=quantized, int4_kernel=self.int4_kernel,
                                         packs=packs)
            packs.save()
            self.prompt_kernel = resolve_prompt_kernel(self.config.prompt_kernel, self.int4_kernel,
                                                       torch.get_num_threads())
            self.prefill_decoder = self._prompt_decoder()
        elif not use_graphs and self.config.decoder == "auto":
            # the dense kernel is resolved (perhaps timed) only where the owned decoder will multiply with it
            dense_dtype = self._dense_dtype(packable) if decoder_reason(model) is None else None
            if dense_dtype is not None:
                self.dense_kernel = resolve_dense_kernel(self.config.dense_kernel, dense_dtype,
                                                         torch.get_num_threads())
            self.decoder = build_decoder(model, packed=packable, dense_dtype=dense_dtype,
                                         dense_kernel=self.dense_kernel or "onednn")
            if dense_dtype is not None:
                self.prefill_decoder = self.decoder.with_whole_products()
        if packable and self.decoder is None:
            self.packing = LinearPacking(model)
            self.fused_groups = fuse_shared_inputs(model, torch.arange(4).unsqueeze(0))
        fusable = (use_graphs and self.config.decoder == "auto"
                   and cuda_fusion.unavailable(model, self.device, self.dtype) is None)
        self._fused = cuda_fusion.install(model) if fusable else None
        model.set_attn_implementation(attention.register())
        packed = packable and (self.packing is not None or self.decoder is not None)
        self.kind = "graphs" if use_graphs else "int4" if quantized else "packed" if packed else "eager"
        own_cpu_decoder = self.decoder is not None and not use_graphs
        cuda_reason = cuda_attention.unavailable(self.device, self.dtype) if use_graphs else "CUDA graphs off"
        #: exact attention on the CUDA graphs (Triton); :attr:`exact` is the CPU decoder's
        self.graph_exact = self.config.attention in ("auto", "exact") and cuda_reason is None
        self.exact = not self.graph_exact and (self.config.attention == "exact" or (
            self.config.attention == "auto" and own_cpu_decoder and self.device.type == "cpu"))
        if self.exact and not own_cpu_decoder:
            raise InputError("exact tree attention needs hierspec's own decoder on the CPU (a Llama-family model, "
                             f"not --decoder transformers) or CUDA graphs with Triton ({cuda_reason})")
        self.buckets: Sequence[int] = (self.config.buckets if self.config.buckets is not None
                                       else default_buckets(self.kind, self.device, self.dtype))
        # keys attended in whole blocks of CPU attention: a row's attention then does not depend on the tree beside it
        self.align = PACKED_KV_ALIGN if self.kind in ("packed", "int4") else 1
        text_config = model.config.get_text_config(decoder=True)
        self.num_layers = int(text_config.num_hidden_layers)
        heads = int(getattr(text_config, "num_attention_heads", 1))
        self.kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
        self.inputs = TreeInputs(self.device, groups=heads // self.kv_heads, align=self.align)
        self.graphed = (GraphedForward(model, self.device, heads // self.kv_heads, capture=True, exact=self.graph_exact)
                        if use_graphs else None)
        self.kv_dtype = self._cache_dtype()
        self._static_cache: StaticTreeCache | None = None
        self._batch_inputs: list[TreeInputs] = []  # one per sequence of a batched forward, allocated once

    def _quantized_weights(self) -> dict[str, list[Int4Weight]] | None:
        """The GGUF file's int4 passes when the int4 path applies (``auto`` or ``int4``), else ``None`` with the
        reason logged (an :class:`InputError` when ``int4`` was asked for)."""
        if self.config.kind not in ("auto", "int4"):
            return None
        reason = self._int4_reason()
        weights = None
        if reason is None and self.config.gguf is None:
            weights, reason = float_weights_4bit(self.model)
        elif reason is None:
            weights, reason = load_gguf_weights(self.config.gguf, self.model.config, self.config.gguf_cache,
                                                requantize=self.config.requantize == "4bit")
        if reason is not None:
            if self.config.kind == "int4":
                raise InputError(f"the int4 runtime is unavailable: {reason}")
            if self.config.gguf is not None:
                log.info("GGUF weights run dequantized: %s", reason)
            elif self.config.requantize == "4bit":
                log.info("the weights run as loaded, not rounded to 4 bits: %s", reason)
        return weights

    def _packed_store(self) -> PackedStore:
        """Where the int4 projections' packed stacks are kept: beside the weight cache this load read (none without
        a cache directory or for PyTorch's int4 kernel, whose packing is PyTorch's own)."""
        kernels = self.int4_kernel
        if self.config.gguf_cache is None or "torch" in (kernels.four_bit, kernels.eight_bit):
            return PackedStore(None, {})
        weights = Path(self.config.gguf_cache) / (REQUANTIZED_CACHE_FILE if self.config.requantize == "4bit"
                                                  else CACHE_FILE)
        return PackedStore.beside(weights, kernels, six_bit_products(loaded_kernel()))

    def _prompt_decoder(self) -> LlamaFamilyDecoder | None:
        """How the int4 path reads prompts (:attr:`prompt_kernel`): the file's weights expanded (held anyway by the
        loaded model; on a bfloat16 copy of the layers' weights where the CPU computes bfloat16), or a view of the
        integer products' packed weights with rows as one or two 8-bit codes an input; ``None``: :attr:`decoder`
        itself, whose rows already are."""
        if self.prompt_kernel == "expanded":
            return build_decoder(self.model, packed=False, product_dtype=expanded_product_dtype(self.dtype))
        if self.prompt_kernel == self.int4_kernel.four_bit:
            return None
        return self.decoder.with_row_codes(one_code=self.prompt_kernel == "vnni8")

    def _dense_dtype(self, packable: bool) -> torch.dtype | None:
        """The products' dtype where the owned decoder runs the compiled layers over the model's own weights: a
        float32 or bfloat16 model whose weights oneDNN packs on this CPU (prepacked as loaded; rows, norms and
        attention in float32 as on the int4 path — one compiled call a forward instead of ~40 PyTorch operations a
        layer); ``None`` elsewhere (float64, eager, CUDA: the Python layers)."""
        dense = packable and self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        return self.dtype if dense else None

    def _int4_reason(self) -> str | None:
        if self.config.gguf is None and self.config.requantize != "4bit":
            return "the model was not loaded from a GGUF file"
        if self.config.gguf is None and self.dtype != torch.float32:
            return "a checkpoint's weights are rounded to 4 bits from a float32 model only"
        if self.device.type != "cpu":
            return "the int4 path runs on the CPU only"
        if self.config.decoder != "auto":
            return "the int4 path needs hierspec's own decoder (--decoder transformers was asked for)"
        reason = decoder_reason(self.model)
        if reason is None:
            self.int4_kernel, reason = resolve_kernel(self.config.int4_kernel)
        return reason

    def _cache_dtype(self) -> torch.dtype | None:
        """The KV cache's storage dtype: float16 where the compiled layers attend exactly over quantized or bfloat16
        weights (``auto``) or where it was asked for; ``None``: the model's dtype."""
        if self.config.kv_cache == "model":
            return None
        compiled = self.exact and self.layer_calls == "compiled-exact"
        if self.config.kv_cache == "float16" and not compiled:
            raise InputError("a float16 KV cache needs the compiled layers with exact attention (a GGUF file or a "
                             "float32/bfloat16 model on the CPU, --attention exact, the compiled extension built)")
        # a float32 model keeps float32 entries unless asked: its arithmetic stays within 1e-5 of transformers'
        narrow = self.config.kv_cache == "float16" or self.kind == "int4" or self.dtype != torch.float32
        return torch.float16 if compiled and narrow else None

    def _packing_reason(self) -> str | None:
        """Why linears run unpacked (``--runtime eager``, not the CPU, a dtype oneDNN does not pack), or ``None``."""
        if self.config.kind == "eager":
            return "the eager runtime was asked for"
        reason = "the model is not on the CPU" if self.device.type != "cpu" else probe(self.dtype)
        if reason is not None:
            if self.config.kind == "packed":
                raise InputError(f"the packed runtime is unavailable: {reason}")
            log.info("eager linear layers: %s", reason)
        return reason

    def describe(self) -> dict:
        """What runs, for benchmark records."""
        return {"kind": self.kind, "buckets": list(self.buckets),
                "packed_linears": len(self.packing) if self.packing is not None else 0,
                "fused_groups": len(self.fused_groups), "decoder": self.decoder_name,
                "weights": (("gguf-int4" if self.config.gguf else "rounded-int4") if self.kind == "int4"
                            else str(self.dtype).removeprefix("torch.")),
                "attention": "exact" if self.exact or self.graph_exact else "sdpa",
                "int4_kernel": self.int4_kernel.four_bit if self.kind == "int4" else None,
                "int8_kernel": self.int4_kernel.eight_bit if self.kind == "int4" else None,
                "prompt_kernel": self.prompt_kernel, "dense_kernel": self.dense_kernel,
                "short_prompt_rows": self.short_prompt_rows if self.prefill_decoder is not None else None,
                "graphs_captured": self.graphed.captures if self.graphed is not None else 0,
                "kv_cache": str(self.cache_dtype).removeprefix("torch."),
                "layers": self.layer_calls}

    @property
    def fused_layers(self) -> bool:
        """Whether transformers' layers run :mod:`~hierspec.runtime.cuda_fusion`'s fused forwards (CUDA graphs)."""
        return self._fused is not None

    @property
    def decoder_name(self) -> str:
        """Whose forward runs: ``"hierspec"`` (the owned decoder), ``"transformers-fused"`` (transformers' layers with
        :mod:`~hierspec.runtime.cuda_fusion`'s forwards) or ``"transformers"``."""
        return "hierspec" if self.decoder else "transformers-fused" if self.fused_layers else "transformers"

    @property
    def short_prompt_rows(self) -> int:
        """The longest prompt (in rows) read by :attr:`decoder` although :attr:`prefill_decoder` reads prompts: where
        ``auto`` chose the expanded weights, timed once per machine and model shape
        (:func:`~hierspec.runtime.prompt_kernel.timed_short_prompt_rows`); 0 otherwise."""
        if self._short_prompt_rows is None:
            timed = (self.prefill_decoder is not None and self.config.prompt_kernel == "auto"
                     and self.prompt_kernel == "expanded")
            self._short_prompt_rows = prompt_choice.timed_short_prompt_rows(
                self._shape_key(), torch.get_num_threads(), self._time_prompt) if timed else 0
        return self._short_prompt_rows

    def _shape_key(self) -> str:
        """A short hash of what a prompt's reading time depends on besides the machine: the model's shapes, the
        kernels, the weights' storage (the file's name and size, requantized or not) and the dtype."""
        text = self.model.config.get_text_config(decoder=True)
        gguf = Path(self.config.gguf) if self.config.gguf else None
        parts = [text.hidden_size, text.intermediate_size, self.num_layers, self.kv_heads, self.head_dim,
                 self.int4_kernel, self.config.requantize, self.dtype,
                 gguf.name if gguf else None, gguf.stat().st_size if gguf and gguf.is_file() else None]
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]

    def _time_prompt(self, rows: int, tree: bool) -> float:
        """Seconds of reading a ``rows``-token prompt onto an empty cache by the tree products or expanded."""
        ids = (torch.arange(rows, device=self.device) % self.decoder.embedding.shape[0])[None]
        cache = self.eager_cache(rows)
        start = time.perf_counter()
        with torch.inference_mode():
            self._read_prompt(cache, ids, slice(rows - 1, rows), False, self.decoder if tree else self.prefill_decoder)
        return time.perf_counter() - start

    @property
    def requantized(self) -> bool:
        """Whether the int4 path runs the file's weights rounded to 4 bits (``RuntimeConfig.requantize``)."""
        return self.kind == "int4" and self.config.requantize == "4bit"

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache stores entries in (:attr:`kv_dtype`, or the model's)."""
        return self.kv_dtype or self.dtype

    @property
    def layer_calls(self) -> str:
        """How the owned decoder's layers run: ``"compiled-exact"`` (each layer one compiled call with its exact
        attention), ``"compiled-halves"`` (compiled halves around attention), ``"python"`` (operation by operation)
        or ``"transformers"``."""
        if self.decoder is None:
            return "transformers"
        fused = self.decoder._fused
        if fused is None:
            return "python"
        return "compiled-exact" if self.exact and fused.attends else "compiled-halves"

    def new_cache(self, capacity: int | None = None) -> TreeCache | StaticTreeCache:
        """An empty KV cache with room for ``capacity`` entries.

        With graphs this is the runtime's one static cache, emptied (graphs hold its address): one generation at a
        time per loaded model. It is replaced by a larger one, and the graphs recaptured, when ``capacity`` exceeds
        it. Otherwise a new growing cache.
        """
        if self.graphed is None:
            return self.eager_cache(capacity)
        needed = max(MIN_CAPACITY, (capacity or 0) + max(self.buckets, default=1))
        if self._static_cache is None or self._static_cache.capacity < needed:
            size = doubled_capacity(MIN_CAPACITY, needed)
            self._static_cache = None  # free the old buffer before the new one is allocated
            self.graphed.forget()
            self._static_cache = StaticTreeCache(self.num_layers, self.kv_heads, self.head_dim, size, self.dtype,
                                                 self.device)
        self._static_cache.reset()
        return self._static_cache

    def eager_cache(self, capacity: int | None = None, modules: bool = False) -> TreeCache:
        """A growing cache for eager forwards of any batch, whatever the runtime's kind; with ``modules``, for
        forwards through the model's own modules (batched generation), whose attention takes entries in the model's
        dtype only (not the float16 of the compiled layers' cache)."""
        capacity = -(-(capacity or DEFAULT_CAPACITY) // self.align) * self.align  # aligned views never regrow
        return TreeCache(self.num_layers, capacity, None if modules else self.kv_dtype)

    def slot_caches(self, slots: int, capacity: int | None = None) -> list[TreeCache]:
        """``slots`` caches for sequences verified together by :meth:`forward_trees`: with the owned decoder, slots of
        one :class:`~hierspec.runtime.slots.SlotPool` (one attention call per layer for the whole batch); otherwise
        independent growing caches."""
        capacity = -(-max(capacity or 0, MIN_SLOT_CAPACITY) // self.align) * self.align
        if not self.batches:
            return [self.eager_cache(capacity) for _ in range(slots)]
        return list(SlotPool(self.num_layers, slots, capacity, self.kv_dtype).caches)

    @torch.inference_mode()
    def prefill(self, cache, ids: Sequence[int], want_hidden: bool = False) -> torch.Tensor | None:
        """Fill the cache with ``ids``; with ``want_hidden``, the last hidden state of the last of them."""
        if isinstance(cache, StaticTreeCache):
            return self.graphed.prefill(cache, ids, want_hidden)
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        if self.decoder is not None:
            return self._owned_prefill(cache, input_ids, want_hidden)
        out = self.model(input_ids=input_ids, **cache_argument(self.model, cache), use_cache=True, logits_to_keep=1,
                         output_hidden_states=want_hidden)
        return out.hidden_states[-1][0, -1] if want_hidden else None

    def rows_for(self, tree_size: int) -> int:
        """Rows a tree of ``tree_size`` nodes is verified in."""
        return bucket_for(tree_size, self.buckets)

    def head_over(self, tokens: torch.Tensor) -> VocabHead:
        """A head over ``tokens`` only, for :meth:`forward_tree`'s ``head``."""
        tokens = tokens.to(self.device, torch.long)
        return VocabHead(tokens, self.decoder.head_over(tokens) if self.decoder is not None else None)

    @torch.inference_mode()
    def forward_tree(self, cache: TreeCache, tree, want_hidden: bool = False, head: VocabHead | None = None):
        """One verification forward of ``tree`` on top of ``cache``: ``(logits [n, vocab], hidden [n, h] | None)``;
        with ``head``, the logits of its tokens only, ``[n, len(head.tokens)]``.

        The cache grows by the padded row count; the caller keeps the accepted entries afterwards.
        """
        if isinstance(cache, StaticTreeCache):
            logits, hidden = self.graphed.forward_tree(cache, tree, self.rows_for(tree.size), want_hidden)
            return (logits if head is None else logits[:, head.tokens]), hidden
        rows = self.rows_for(tree.size)
        if self.decoder is not None and self.exact and head is None:
            stepped = self.decoder.tree_step(cache, tree, rows, want_hidden)
            if stepped is not None:
                return stepped
        past = cache.get_seq_length()
        ids, positions, mask, plan = self._tree_inputs(self.inputs, tree, past, rows)
        if self.decoder is not None:
            with cache.aligned(self.align):
                return self.decoder.forward(ids, positions, mask, cache, slice(0, tree.size), want_hidden,
                                            self.exact, head=None if head is None else head.projection, plan=plan)
        with cache.aligned(self.align):
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                             **cache_argument(self.model, cache), use_cache=True, output_hidden_states=want_hidden,
                             logits_to_keep=self.inputs.row_index(tree.size))
        hidden = out.hidden_states[-1][0, : tree.size] if want_hidden else None
        return (out.logits[0] if head is None else out.logits[0][:, head.tokens]), hidden

    def _tree_inputs(self, inputs: TreeInputs, tree, past: int, rows: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ExactPlan | None]:
        """A tree forward's ids and positions with, for exact attention (only ever on the owned decoder: checked at
        construction), the rows' plan made from the tree (no mask), else the mask (no plan)."""
        if self.exact:
            ids, positions, plan = inputs.fill_exact(tree, past, rows)
            return ids, positions, None, plan
        ids, positions, mask = inputs.fill(tree, past, rows)
        return ids, positions, mask, None

    @property
    def batches(self) -> bool:
        """Whether :meth:`forward_trees` verifies several sequences in one forward (the owned decoder on the CPU);
        otherwise it runs one forward per sequence."""
        return self.decoder is not None and self.graphed is None

    @torch.inference_mode()
    def forward_trees(self, caches: Sequence[TreeCache], trees: Sequence, want_hidden: bool = False) -> list:
        """One verification forward of several sequences' trees, each on top of its own cache: ``[(logits, hidden |
        None)]`` per tree, each equal to what :meth:`forward_tree` gives that tree alone.

        Every weight product runs once over all trees' rows (the weights stream once); attention runs over each
        tree's own cache — in one call per layer when the caches are slots of one pool (:meth:`slot_caches`), else
        per tree. The trees are not padded to buckets (the products are row-invariant, and a row's attention does
        not depend on the rows beside it); only a forward of fewer rows than the smallest bucket is padded, on its
        last tree. Without the owned decoder (or with CUDA graphs) the trees are verified one after another.
        """
        if len(trees) == 1 or not self.batches:
            return [self.forward_tree(cache, tree, want_hidden) for cache, tree in zip(caches, trees)]
        while len(self._batch_inputs) < len(trees):
            self._batch_inputs.append(TreeInputs(self.device, groups=self.inputs.groups, align=self.align))
        total = sum(tree.size for tree in trees)
        extra = max(0, min(self.buckets, default=1) - total)
        ids, positions, segments, keep, start = [], [], [], [], 0
        for index, (cache, tree) in enumerate(zip(caches, trees)):
            rows = tree.size + (extra if index == len(trees) - 1 else 0)
            tree_ids, tree_positions, mask, plan = self._tree_inputs(self._batch_inputs[index], tree,
                                                                     cache.get_seq_length(), rows)
            segments.append(Segment(start, start + rows, mask, cache, plan))
            ids.append(tree_ids)
            positions.append(tree_positions)
            keep.extend(range(start, start + tree.size))
            start += rows
        keep_index = torch.tensor(keep, device=self.device) if extra else slice(0, total)
        with contextlib.ExitStack() as stack:
            for cache in caches:
                stack.enter_context(cache.aligned(self.align))
            logits, hidden = self.decoder.forward_segments(torch.cat(ids, dim=1), torch.cat(positions, dim=1),
                                                           segments, keep_index, want_hidden, self.exact)
        bounds = np.cumsum([0] + [tree.size for tree in trees])
        return [(logits[a:b], None if hidden is None else hidden[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states (after the final norm) ``[batch, length, hidden]`` of sequences read as prompts, for
        building stores: each row's tokens where ``attention_mask`` is 1 (a prefix of the row; zeros after it), on a
        cache of its own through the decoder that reads prompts. Only where the runtime has its own decoder on the
        CPU (:attr:`batches`); the int4 path then reads them several times faster than transformers' float32 modules
        (Qwen2.5-Coder-1.5B: ~30 ms a token there)."""
        if not self.batches:
            raise ValueError("hidden states through the runtime need its own decoder on the CPU")
        lengths = (attention_mask.sum(dim=1) if attention_mask is not None
                   else torch.full((input_ids.shape[0],), input_ids.shape[1])).tolist()
        out = self.decoder.embedding.new_zeros((*input_ids.shape, self.decoder.embedding.shape[1]))
        for row, count in enumerate(int(n) for n in lengths):
            if count:
                ids = input_ids[row : row + 1, :count].to(self.device)
                out[row, :count] = self._read_prompt(self.eager_cache(count), ids, slice(0, count), want_hidden=True)
        return out

    def _owned_prefill(self, cache: TreeCache, input_ids: torch.Tensor, want_hidden: bool) -> torch.Tensor | None:
        """Causal forward of the prompt through the owned decoder (only its last row's outputs are computed)."""
        count = input_ids.shape[-1]
        hidden = self._read_prompt(cache, input_ids, slice(count - 1, count), want_hidden)
        return hidden[-1] if want_hidden else None

    def _read_prompt(self, cache: TreeCache, input_ids: torch.Tensor, keep: slice, want_hidden: bool,
                     decoder: LlamaFamilyDecoder | None = None) -> torch.Tensor | None:
        """The prompt ``input_ids`` ``[1, count]`` read onto ``cache`` by ``decoder``, by default the one that reads
        a prompt of that length; the hidden states of the rows ``keep`` selects (with ``want_hidden``). Keys
        unaligned, as transformers' own prefill attends them."""
        past, count = cache.get_seq_length(), input_ids.shape[-1]
        positions = torch.arange(past, past + count, device=self.device)
        # on an empty cache the prompt is attended causally without a mask (the decoder's one-call causal path)
        mask = None if past == 0 else (torch.arange(past + count, device=self.device)[None, :] <= positions[:, None]
                                       )[None, None]
        if decoder is None:
            long = self.prefill_decoder is not None and count > self.short_prompt_rows
            decoder = self.prefill_decoder if long else self.decoder
        with cache.aligned(1):
            _, hidden = decoder.forward(input_ids, positions[None], mask, cache, keep, want_hidden, want_logits=False)
        return hidden

    @contextlib.contextmanager
    def stock(self) -> Iterator[None]:
        """Run the block on the model exactly as transformers loaded it (its own linears and attention)."""
        if self.packing is not None:
            self.packing.stock()
        if self._fused is not None:
            self._fused.stock()
        self.model.set_attn_implementation(self._stock_attention)
        try:
            yield
        finally:
            self.model.set_attn_implementation(attention.NAME)
            if self.packing is not None:
                self.packing.packed()
            if self._fused is not None:
                self._fused.fused()


@dataclass(frozen=True)
class VocabHead:
    """A head over some tokens only (a draft model's shortlist, :meth:`Runtime.head_over`): ``tokens`` (int64 ids,
    on the runtime's device) and the owned decoder's head over their rows, or ``None`` where the runtime runs no
    decoder of its own (the whole head is computed, then those columns taken)."""

    tokens: torch.Tensor
    projection: object | None


@functools.lru_cache(maxsize=1)
def _warn_emulated_bfloat16() -> None:
    """Say once per process that bfloat16 is emulated on this CPU, and what to use instead."""
    log.warning("this CPU has no native bfloat16 (no AVX512_BF16 or AMX): bfloat16 products are emulated, a forward "
                "costs about as much per tree token as a whole step, and drafting cannot pay; load the model with "
                "--dtype float32 (the CPU default) instead")
