"""An owned decoder forward for the Llama family (Llama, SmolLM2, Qwen2 with its q/k/v biases, Mistral).

transformers' modules spend, on a 2-core CPU, about as long in Python and small tensor operations as in the weight
products themselves (SmolLM2-135M, float32, one token: ~48 ms of products inside a ~90 ms forward; BENCHMARKS.md,
"Owned decoder forward"). :class:`LlamaFamilyDecoder` runs the same computation from the loaded weights with far
fewer operations: rows as a flat ``[rows, hidden]`` matrix, queries/keys/values and gate/up each one product (one
oneDNN call with prepacked weights where the runtime packs), rotary factors read from a table that transformers'
own rotary module filled, the cache written through its layer objects, attention by
:func:`~hierspec.runtime.attention.tree_attention`. Every operation repeats transformers' order of arithmetic
(normalisation, rotation, residual sums), so the logits equal transformers' forward — exactly in float64
(``tests/test_decoder.py``).

:func:`build_decoder` returns ``None`` for anything else (other architectures, rotary scalings that depend on the
sequence length, non-SiLU activations); the runtime then runs transformers' modules.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hierspec.runtime import int4_kernel, onednn
from hierspec.runtime.attention import additive_mask, tree_attention
from hierspec.runtime.exact_attention import NATIVE_DTYPES, ExactPlan, exact_attention, exact_attention_blocks
from hierspec.runtime.norm_kernel import rms_norm as compiled_rms_norm
from hierspec.runtime.dense_kernel import BLOCK_OUTPUTS, DotsStack, dense_stack
from hierspec.runtime.onednn import pack_weight, packed_linear
from hierspec.runtime.packed_store import PackedStore
from hierspec.runtime.quantized import CachedWeights, Int4Kernels, Int4Projection, Int4Weight, pack_stacks
from hierspec.runtime.slots import (SlotBatch, SlotPool, SlotWrites, finish_slot_batch, plan_slot_batch,
                                    plan_slot_writes, slot_attention, write_slot_rows)
from hierspec.tree import DraftTree

log = logging.getLogger(__name__)

#: transformers model types whose decoder layers this module reproduces
SUPPORTED_TYPES = ("llama", "qwen2", "mistral")
#: rotary types whose factors depend on the position alone (others rescale with the sequence length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
#: KV-cache dtypes the compiled layers attend exactly (float16: entries rounded once, when written)
COMPILED_CACHE_DTYPES = (torch.float32, torch.float16)
#: positions the rotary table starts with; it doubles on demand up to the model's context
TABLE_START = 4096
#: outputs per block of the int4 layouts (a weight's rows are a whole number of them)
INT4_OUTPUT_BLOCK = 16


class Projection:
    """Several linears applied to one input: one product of their stacked weights, or each on its own.

    ``packed``: one oneDNN product with a prepacked copy of the stacked weight (a second copy of these weights, as
    the packed runtime keeps anyway); ``product_dtype``: one product in that dtype with a stacked copy of the weights
    in it (prepacked where oneDNN packs that dtype), rows rounded to it and the result (plus float32 biases) in the
    rows' dtype (with ``narrow_output``, a bias-free product stays in the product dtype: the MLP's gate and up
    products, whose activation then runs on half the bytes); else ``F.linear`` on each module's own weight (no copy).

    Prepacking a bfloat16 copy spares oneDNN reordering the weight on every call (on an Intel Xeon with AMX the
    same kernel runs and the bits equal ``F.linear``'s; BENCHMARKS.md, "Forty-second session", for the time).
    """

    def __init__(self, linears: Sequence[nn.Module], packed: bool, product_dtype: torch.dtype | None = None,
                 narrow_output: bool = False) -> None:
        weights = [m.weight.detach() for m in linears]
        biases = [None if m.bias is None else m.bias.detach() for m in linears]
        self.widths = [w.shape[0] for w in weights]
        self.packed = packed or product_dtype is not None
        self.product_dtype = product_dtype
        self.narrow_output = narrow_output and product_dtype is not None and all(b is None for b in biases)
        self.prepacked = self.packed and (product_dtype is None or onednn.probe(product_dtype) is None)
        if self.packed:
            stacked = _stacked(weights, product_dtype or weights[0].dtype)
            self.weight = pack_weight(stacked) if self.prepacked else stacked
            self.bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        else:
            self.weights, self.biases = weights, biases

    def __call__(self, rows: torch.Tensor, split: bool = True) -> list[torch.Tensor]:
        """The members' products with ``rows``; packed and ``split=False``: one tensor of them all side by side."""
        if self.product_dtype is not None:
            product = self.raw(rows.to(self.product_dtype))
            if not self.narrow_output:
                product = product.to(rows.dtype)
                product = product if self.bias is None else product + self.bias
        elif self.packed:
            product = packed_linear(rows, self.weight, self.bias)
        else:
            return [F.linear(rows, w, b) for w, b in zip(self.weights, self.biases)]
        return list(product.split(self.widths, dim=-1)) if split else [product]

    def raw(self, rows: torch.Tensor) -> torch.Tensor:
        """The stacked product of ``rows`` already in :attr:`product_dtype`, left in it and without the bias (the
        prompt glue widens it and adds what follows)."""
        return packed_linear(rows, self.weight, None) if self.prepacked else F.linear(rows, self.weight)


@dataclass(frozen=True)
class _Rows:
    """Some rows of a linear's weight (and bias), as :class:`Projection` takes a linear."""

    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class _FirstColumns:
    """A one-member projection's first ``count`` outputs."""

    projection: Int4Projection
    count: int

    def __call__(self, rows: torch.Tensor, split: bool = True) -> list[torch.Tensor]:
        return [self.projection(rows)[0][:, : self.count]]


@dataclass(frozen=True)
class Segment:
    """One sequence's rows ``start .. stop - 1`` in a batched forward, with its attention mask (the runtime's boolean
    ``[1, 1, rows or groups * rows, width]``, or ``None`` for a prompt on an empty cache: causal) and its own KV
    cache; for exact attention its rows' :class:`ExactPlan` may stand in for the mask (made from the tree)."""

    start: int
    stop: int
    mask: torch.Tensor | None
    cache: object
    plan: ExactPlan | None = None

    @property
    def causal(self) -> bool:
        """Whether the rows are a prompt on an empty cache (no mask, no plan)."""
        return self.mask is None and self.plan is None

    def exact_plan(self) -> ExactPlan:
        """The rows' exact-attention plan: the given one, else read from the mask."""
        return self.plan if self.plan is not None else ExactPlan(self.mask[0, 0, : self.stop - self.start])


@dataclass
class _Layer:
    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: Projection | Int4Projection
    out: Projection | Int4Projection
    gate_up: Projection | Int4Projection
    down: Projection | Int4Projection


class LlamaFamilyDecoder:
    """The forward of a Llama-family causal LM over one sequence's rows, on the runtime's KV cache.

    Attributes:
        eps: the RMS norms' epsilon; ``heads``, ``kv_heads``, ``head_dim``: attention shape; ``scaling``: the
            attention's score scale, as transformers' module holds it.
    """

    def __init__(self, model: nn.Module, packed: bool,
                 quantized: Mapping[str, Sequence[Int4Weight]] | None = None,
                 product_dtype: torch.dtype | None = None, int4_kernel: Int4Kernels | None = None,
                 packs: PackedStore | None = None, dense_dtype: torch.dtype | None = None,
                 dense_kernel: str = "onednn") -> None:
        inner = model.model
        config = model.config
        attention = inner.layers[0].self_attn
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)
        self.eps = float(inner.norm.variance_epsilon)
        self.embedding = inner.embed_tokens.weight.detach()
        if quantized is not None and self.embedding.device.type == "cpu":
            # a GGUF file's converted weights are a file mapping: each new token's row was a page fault (~0.4 ms on a
            # Zen 4 under KVM, ~5 % of a SmolLM2 step); the int4 path reads its own copy (SmolLM2: 113 MB, ~35 ms)
            self.embedding = self.embedding.clone()
        if dense_dtype is not None:  # the compiled layers' rows are float32 whatever the weights' dtype
            self.embedding = self.embedding.float()
        self._dense_dtype = dense_dtype
        self._dense_kernel = dense_kernel
        self.final_norm = _float_weight(inner.norm.weight, dense_dtype)
        # a prompt's attention runs in the products' dtype (bfloat16 halves its time where the CPU computes it)
        self._prompt_dtype = product_dtype or self.embedding.dtype
        names = {module: name for name, module in model.named_modules()}
        kernels = int4_kernel or Int4Kernels("torch", "torch")

        store = packs if packs is not None else PackedStore(None, {})  # without one, every stack is packed here

        def projection(*linears: nn.Module, copy: bool = True, narrow: bool = False) -> Projection | Int4Projection:
            if dense_dtype is not None:
                return _dense_projection([m.weight for m in linears], [m.bias for m in linears], dense_dtype,
                                         dense_kernel)
            if quantized is None:
                return Projection(linears, packed, product_dtype if copy else None, narrow_output=narrow)
            stacks = store.stacks("+".join(names[m] for m in linears), lambda: pack_stacks(
                [quantized[names[m]] for m in linears], kernels.four_bit, kernels.eight_bit))
            return Int4Projection(None, [m.bias for m in linears], widths=[m.weight.shape[0] for m in linears],
                                  stacks=stacks)

        # a decoder with a product dtype reads prompts, whose logits nobody reads: its head keeps the loaded weight
        head = model.get_output_embeddings()
        self.lm_head = projection(head, copy=False)
        self._head_source = (head, _head_passes(quantized, names[head]) if quantized is not None else None, kernels)
        self.layers = [_Layer(norm1=_float_weight(layer.input_layernorm.weight, dense_dtype),
                              norm2=_float_weight(layer.post_attention_layernorm.weight, dense_dtype),
                              qkv=projection(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                              out=projection(layer.self_attn.o_proj),
                              # a prompt's gate and up products stay bfloat16 into the activation: the float32
                              # round trip of [rows, 2 x intermediate] was a third of a 950-token prompt's time
                              gate_up=projection(layer.mlp.gate_proj, layer.mlp.up_proj, narrow=True),
                              down=projection(layer.mlp.down_proj))
                       for layer in inner.layers[: config.num_hidden_layers]]
        self._rotary = inner.rotary_emb
        self._max_positions = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        self._cos = self._sin = self.embedding.new_empty((0, self.head_dim))
        # the int4 path's model is its own arithmetic (file codes, its kernel's roundings), and so is that of the
        # compiled layers over a float32 or bfloat16 model's prepacked weights (float32 rows; within float32 rounding
        # of transformers'): there the norms run as one compiled call each, and with the compiled extension each
        # layer half around attention is one call (Int4Layers); other paths (float64, eager) keep PyTorch's
        # operations, equal to transformers'
        compiled = (quantized is not None or dense_dtype is not None) and self.embedding.dtype == torch.float32
        self._fused = Int4Layers.for_decoder(self) if compiled else None
        self._norm = self._fused.norm if self._fused is not None else compiled_rms_norm if compiled else _rms_norm
        self._activation = self._fused.activation if self._fused is not None else _silu_product
        self._glue = _PromptGlue.for_decoder(self, product_dtype) if quantized is None else None

    @property
    def dense_dtype(self) -> torch.dtype | None:
        """The dtype of the prepacked weights where this decoder runs the compiled layers over a float model's own
        weights (:func:`build_decoder`'s ``dense_dtype``), else ``None``."""
        return self._dense_dtype

    def with_row_codes(self, one_code: bool) -> LlamaFamilyDecoder:
        """This int4 decoder with its layers' integer (VNNI) products taking rows as one 8-bit code an input or as
        two (:meth:`~hierspec.runtime.quantized.Int4Projection.with_row_codes`): the same packed weights, embedding
        and norms, shared. Its head is this decoder's (the view reads prompts, whose logits are never computed)."""
        if self._fused is None:
            raise ValueError("rows as integer codes need the int4 path's compiled layers")
        return self._projections_view(lambda projection: projection.with_row_codes(one_code))

    def with_whole_products(self) -> LlamaFamilyDecoder:
        """This decoder over a model's float weights (``dense_dtype``) with each product taking any number of rows in
        one call (:meth:`~hierspec.runtime.quantized.Int4Projection.with_whole_products`): the view that reads
        prompts, ~2x faster than in the calls of a few dozen rows that keep a tree's rows invariant."""
        if self._dense_dtype is None:
            raise ValueError("whole products are the compiled layers' over float weights")
        return self._projections_view(lambda projection: projection.with_whole_products())

    def _projections_view(self, change: Callable[[Int4Projection], Int4Projection]) -> LlamaFamilyDecoder:
        """This decoder with ``change`` applied to every layer's projections; embedding, norms and head shared."""
        view = copy.copy(self)
        view.layers = [replace(layer, **{name: change(getattr(layer, name))
                                         for name in ("qkv", "out", "gate_up", "down")}) for layer in self.layers]
        if self._fused is not None:
            view._fused = self._fused.for_view(view)
            view._norm, view._activation = view._fused.norm, view._fused.activation
        return view

    def head_over(self, tokens: torch.Tensor) -> Projection | _FirstColumns:
        """A head computing only the logits of ``tokens`` (int64 ids), in their order: the output embedding's rows
        of those tokens, in the same form as the whole head (each logit the same arithmetic as the whole head's)."""
        head, passes_of, kernels = self._head_source
        bias = None if head.bias is None else head.bias.detach()
        if self._dense_dtype is not None:
            if not isinstance(self.lm_head.stacks[0], DotsStack):  # oneDNN's, as the whole head (whatever its shape)
                return _dense_projection([head.weight[tokens]], [_rows_of(bias, tokens)], self._dense_dtype, "onednn")
            padded = _whole_blocks(tokens, BLOCK_OUTPUTS)
            return _FirstColumns(_dense_projection([head.weight[padded]], [_rows_of(bias, padded)], self._dense_dtype,
                                                   self._dense_kernel), tokens.numel())
        passes = None if passes_of is None else passes_of()
        if passes is None:
            return Projection([_Rows(head.weight.detach()[tokens], _rows_of(bias, tokens))], packed=False)
        padded = _whole_blocks(tokens, INT4_OUTPUT_BLOCK)
        return _FirstColumns(Int4Projection([[weight.take_rows(padded) for weight in passes]],
                                            [_rows_of(bias, padded)], kernels.four_bit, kernels.eight_bit),
                             tokens.numel())

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                keep: slice | torch.Tensor, want_hidden: bool = False, exact: bool = False, want_logits: bool = True,
                head: Projection | _FirstColumns | None = None, plan: ExactPlan | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits ``[kept, vocab]`` of the rows ``keep`` selects (``None`` without ``want_logits``) and their last
        hidden states, after the final norm (with ``want_hidden``): a tree's real nodes, or a prompt's last row.

        ``ids`` and ``positions`` are ``[1, rows]``, ``mask`` the runtime's boolean ``[1, 1, rows or groups * rows,
        width]``, or ``None`` when the rows are a prompt on an empty cache (causal attention, one call per layer that
        skips the masked half); every layer's keys and values go into ``cache`` through its layer's ``update``.
        ``exact`` (with a ``mask`` or a ``plan``, not for a causal prompt): attention
        by :func:`~hierspec.runtime.exact_attention.exact_attention` (a row's result independent of the tree's
        layout); ``plan`` (exact only) stands in for ``mask``: :meth:`ExactPlan.of_tree`.
        """
        return self.forward_segments(ids, positions, [Segment(0, ids.shape[-1], mask, cache, plan)], keep,
                                     want_hidden, exact, want_logits, head)

    def forward_segments(self, ids: torch.Tensor, positions: torch.Tensor, segments: Sequence[Segment],
                         keep: slice | torch.Tensor, want_hidden: bool = False, exact: bool = False,
                         want_logits: bool = True, head: Projection | _FirstColumns | None = None
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The forward of several sequences' rows at once: every product over all rows (the weights stream once),
        attention per :class:`Segment` over its own cache with its own mask — the very operations each sequence's
        own forward runs, so (the products being row-invariant) each row's result is the same as alone. When every
        cache is a slot of one :class:`~hierspec.runtime.slots.SlotPool`, each layer's attention is one call for
        all sequences (:func:`~hierspec.runtime.slots.slot_attention`), with the same results; with ``exact``,
        attention is :func:`~hierspec.runtime.exact_attention.exact_attention` per sequence, or one call of
        :func:`~hierspec.runtime.exact_attention.exact_attention_blocks` per layer over such a pool."""
        rows = ids.shape[-1]
        cos, sin = self._rotation(positions.reshape(-1))
        slots = None if exact else self._slot_batch(segments)
        plans = [s.exact_plan() for s in segments] if exact else None
        pooled = self._exact_pool(segments, plans) if exact else None
        if pooled is not None:
            slots, plans = pooled
        # the additive form SDPA makes of a boolean mask, made once per forward instead of once per layer
        segments = [] if slots is not None else segments if exact else [
            Segment(s.start, s.stop, None if s.mask is None else additive_mask(s.mask, self.embedding.dtype), s.cache)
            for s in segments]
        hidden = F.embedding(ids.reshape(-1), self.embedding)
        compiled = self._compiled_exact(segments, plans, pooled, rows) if exact and self._fused is not None else None
        if compiled is not None:
            hidden = self._fused.exact_layers(hidden, cos, sin, compiled)
        elif self._glue is not None and not exact and slots is None:
            for index, layer in enumerate(self.layers):
                hidden = self._glue_layer(index, layer, hidden, cos, sin, segments)
        else:
            for index, layer in enumerate(self.layers):
                hidden = self._layer(index, layer, hidden, cos, sin, segments, rows, slots, plans)
        if slots is not None:
            finish_slot_batch(slots)
        if not (want_logits or want_hidden):
            return None, None
        last = self._norm(hidden[keep], self.final_norm, self.eps)
        logits = (head or self.lm_head)(last)[0] if want_logits else None
        return logits, (last if want_hidden else None)

    @staticmethod
    def _shared_pool(segments: Sequence[Segment]) -> SlotPool | None:
        """The allocated pool every sequence's cache is a slot of (two sequences or more), or ``None``."""
        pool = getattr(segments[0].cache, "pool", None)
        if len(segments) < 2 or pool is None or not pool.keys or any(
                getattr(s.cache, "pool", None) is not pool for s in segments):
            return None
        return pool

    def _slot_batch(self, segments: Sequence[Segment]) -> SlotBatch | None:
        """The plan of one attention call per layer when every sequence's cache is a slot of one allocated pool."""
        if self._shared_pool(segments) is None:
            return None
        return plan_slot_batch([s.cache for s in segments], [(s.start, s.stop) for s in segments],
                               [s.mask for s in segments], self.heads // self.kv_heads, self.embedding.dtype)

    def _exact_pool(self, segments: Sequence[Segment], plans: Sequence[ExactPlan]
                    ) -> tuple[SlotWrites, ExactPlan] | None:
        """Where every sequence's cache is a slot of one allocated pool: the rows' key writes, and one exact plan
        over the pool's layer viewed as ``[slots * kv_heads, capacity, d]`` (each row's blocks from its slot's).
        ``None`` for caches elsewhere or of a dtype the kernel does not read directly (attended per sequence)."""
        pool = self._shared_pool(segments)
        if pool is None or pool.keys[0].dtype not in NATIVE_DTYPES + self._compiled_cache_dtypes():
            return None
        writes = plan_slot_writes([s.cache for s in segments], [(s.start, s.stop) for s in segments])
        return writes, ExactPlan.concatenate(plans, writes.slot_index.numpy() * self.kv_heads)

    def _compiled_cache_dtypes(self) -> tuple[torch.dtype, ...]:
        """Cache dtypes beyond :data:`NATIVE_DTYPES` that this decoder attends exactly (the compiled layers')."""
        return COMPILED_CACHE_DTYPES if self._fused is not None and self._fused.attends else ()

    def _compiled_exact(self, segments: Sequence[Segment], plans: Sequence[ExactPlan],
                        pooled: tuple[SlotWrites, ExactPlan] | None, rows: int) -> CompiledExact | None:
        """Where the compiled layers attend exactly over float32 or float16 caches (one sequence's, or a pool's
        slots): their buffers and where this forward's rows go. ``None`` elsewhere (several sequences in separate
        caches; other dtypes), which the Python layers serve."""
        if not self._fused.attends:
            return None
        if pooled is not None:
            writes, plan = pooled
            if writes.pool.keys[0].dtype not in COMPILED_CACHE_DTYPES:
                return None
            buffers = [(k.flatten(0, 1), v.flatten(0, 1)) for k, v in zip(writes.pool.keys, writes.pool.values)]
            return CompiledExact(buffers, writes.slot_index * self.kv_heads, writes.position_index, plan)
        if len(segments) != 1 or not self._compiled_cache(segments[0].cache):
            return None
        start, buffers = self._reserve(segments[0].cache, rows)
        return CompiledExact(buffers, torch.zeros(rows, dtype=torch.long), torch.arange(start, start + rows),
                             plans[0])

    @staticmethod
    def _compiled_cache(cache) -> bool:
        """Whether the compiled layers write and attend ``cache`` directly: one sequence's buffers of a dtype they
        read (or not allocated yet)."""
        if not hasattr(cache, "reserve"):
            return False
        first = cache.layers[0]  # a cache's layers are allocated together, with one dtype and batch
        return not first.is_initialized or (first.dtype in COMPILED_CACHE_DTYPES and first.keys.shape[0] == 1)

    def _reserve(self, cache, rows: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Room for ``rows`` entries after the cache's: their first slot and every layer's buffers."""
        return cache.reserve(rows, self.embedding.new_empty((1, self.kv_heads, 0, self.head_dim)))

    def tree_step(self, cache, tree: DraftTree, rows: int, want_hidden: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """:meth:`forward` of ``tree`` (its nodes, padded to ``rows``) with exact attention and the whole head, as
        one compiled call (``ExactLayerStack.step``: the rows' inputs, plan, every layer, the final norm and the
        head), the same arithmetic as the Python path: ``(logits [n, vocab], hidden [n, h] | None)``. ``None``
        where that call does not apply (no compiled layers, a head other than an int4 one, a cache they do not
        read), before anything is changed."""
        if self._step_head is None or not self._compiled_cache(cache):
            return None
        start, buffers = self._reserve(cache, rows)
        if start + rows > self._cos.shape[0]:
            self._fill_table(start + rows)
        keys, values = zip(*buffers)
        head, bias = self._step_head
        tokens, parents, depths = (torch.from_numpy(_int64(a)) for a in (tree.tokens, tree.parents, tree.depths))
        logits, last = self._fused.layer_stack().step(self.embedding, tokens, parents, depths, start, rows, self._cos,
                                                      self._sin, keys, values, self.final_norm, head, bias)
        return logits, (last if want_hidden else None)

    @property
    def _step_head(self) -> tuple[list, torch.Tensor | None] | None:
        """The head as :meth:`tree_step`'s call takes it, or ``None`` where that call does not apply."""
        head = self.lm_head
        if (self._fused is None or not self._fused.attends or not isinstance(head, Int4Projection)
                or self.embedding.device.type != "cpu" or self.embedding.dtype != torch.float32):
            return None
        return head.native, head.bias

    def _layer(self, index: int, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               segments: Sequence[Segment], rows: int, slots: SlotBatch | SlotWrites | None = None,
               plans: Sequence[ExactPlan] | ExactPlan | None = None) -> torch.Tensor:
        if self._fused is not None:
            query, key, value = self._fused.attention_inputs(layer, hidden, cos, sin)
        else:
            query, key, value = self._attention_inputs(layer, self._norm(hidden, layer.norm1, self.eps), cos, sin, rows)
        return self._mlp(layer, hidden, self._attend(index, query, key, value, segments, slots, plans))

    def _glue_layer(self, index: int, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    segments: Sequence[Segment]) -> torch.Tensor:
        """:meth:`_layer` of the expanded prompt decoder with the compiled glue between its products
        (:class:`_PromptGlue`): ``hidden`` is updated in place and returned."""
        glue, module = self._glue, self._glue.module
        normed = module.prompt_norm(hidden, layer.norm1, self.eps, glue.dtype)
        query, key, value = module.prompt_qkv(layer.qkv.raw(normed), layer.qkv.bias, cos, sin, self.heads,
                                              self.kv_heads, self.head_dim)
        attended = self._attend(index, query, key, value, segments).to(glue.dtype)
        normed = module.prompt_add_norm(hidden, layer.out.raw(attended), layer.norm2, self.eps, glue.dtype)
        act = module.prompt_activation(layer.gate_up.raw(normed), layer.gate_up.widths[0], glue.dtype)
        return module.prompt_add_norm(hidden, layer.down.raw(act), None, self.eps, glue.dtype)

    def _attend(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                segments: Sequence[Segment], slots: SlotBatch | SlotWrites | None = None,
                plans: Sequence[ExactPlan] | ExactPlan | None = None) -> torch.Tensor:
        """Layer ``index``'s keys and values written to the caches and its attention output ``[rows, heads * d]``:
        over a slot pool's blocks, its slots, or each sequence's own cache."""
        if isinstance(slots, SlotWrites):
            write_slot_rows(slots, index, key, value)
            keys, values = (buffer[index].flatten(0, 1) for buffer in (slots.pool.keys, slots.pool.values))
            return exact_attention_blocks(query, keys, values, plans, self.kv_heads, self.scaling)
        if slots is not None:
            return slot_attention(slots, index, query, key, value, self.scaling)
        parts = []
        whole = len(segments) == 1
        for number, s in enumerate(segments):
            keys, values = s.cache.layers[index].update(key if whole else key[:, :, s.start : s.stop],
                                                        value if whole else value[:, :, s.start : s.stop])
            own_query = query if whole else query[:, :, s.start : s.stop]
            if s.causal:  # converts the entries to its own dtype
                parts.append(self._prompt_attention(own_query, keys, values))
                continue
            if keys.dtype != query.dtype:  # a float16 cache: its stored (rounded) entries, widened
                keys, values = keys.to(query.dtype), values.to(query.dtype)
            if plans is not None:
                parts.append(exact_attention(own_query, keys, values, plans[number], self.scaling))
            else:
                attended, _ = tree_attention(None, own_query, keys, values, s.mask, scaling=self.scaling)
                parts.append(attended.reshape(s.stop - s.start, self.heads * self.head_dim))
        return parts[0] if whole else torch.cat(parts, dim=0)

    def _prompt_attention(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Causal attention of a prompt's rows ``[1, heads, rows, d]`` over their own keys and values ``[1, kv_heads,
        rows, d]`` (an empty cache before them) → ``[rows, heads * d]``: in float32 on the CPU the compiled kernel's
        (``prompt_attention.cpp``: 1.6-5x faster than SDPA's flash kernel for SmolLM2's heads up to 800 tokens);
        otherwise SDPA's causal flash kernel, which skips the masked key blocks and reads the grouped heads in
        place."""
        rows, dtype = query.shape[2], self._prompt_dtype
        if self._fused is not None and self._fused.attends_prompts(query, dtype):
            return self._fused.prompt_attention(query.to(dtype), keys.to(dtype), values.to(dtype))
        out = F.scaled_dot_product_attention(query.to(dtype), keys.to(dtype), values.to(dtype), is_causal=True,
                                             scale=self.scaling, enable_gqa=self.heads != self.kv_heads)
        # left in the products' dtype: the output projection takes it as it is (widening it first was a round trip)
        return out.transpose(1, 2).reshape(rows, self.heads * self.head_dim)

    def _mlp(self, layer: _Layer, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The attention's output projection and residual, then the MLP block and its residual."""
        if self._fused is not None:
            return self._fused.mlp(layer, hidden, attended)
        (out,) = layer.out(attended)
        hidden = hidden + out
        gate, up = layer.gate_up(self._norm(hidden, layer.norm2, self.eps))
        (down,) = layer.down(self._activation(gate, up))
        return hidden + down

    def _attention_inputs(self, layer: _Layer, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys and the values, ``[1, heads, rows, head_dim]``; with one packed q/k/v product
        the queries and keys are rotated together (the same element-wise arithmetic, half the operations)."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        if layer.qkv.packed:
            (product,) = layer.qkv(normed, split=False)
            states = product.view(1, rows, heads + 2 * kv_heads, dim).transpose(1, 2)
            rotated = _rotate(states[:, : heads + kv_heads], cos, sin)
            return rotated[:, :heads], rotated[:, heads:], states[:, heads + kv_heads :]
        query, key, value = layer.qkv(normed)
        query = _rotate(query.view(1, rows, heads, dim).transpose(1, 2), cos, sin)
        key = _rotate(key.view(1, rows, kv_heads, dim).transpose(1, 2), cos, sin)
        return query, key, value.view(1, rows, kv_heads, dim).transpose(1, 2)

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and signed ``sin`` rows ``[1, 1, rows, head_dim]`` of the positions, from the table (grown on
        demand)."""
        needed = int(positions.max()) + 1
        if needed > self._cos.shape[0]:
            self._fill_table(needed)
        return self._cos[positions][None, None], self._sin[positions][None, None]

    @torch.inference_mode()
    def _fill_table(self, needed: int) -> None:
        """transformers' own rotary module evaluated at every position once: each factor depends on its position
        alone (a single product and a cos/sin), so the table holds exactly what a forward would compute."""
        size = max(TABLE_START, self._cos.shape[0])
        while size < needed:
            size *= 2
        size = max(needed, min(size, self._max_positions))
        probe = self.embedding[:1][None]
        # first on two positions (one thread): a process's first cos over thousands of positions, shared between two
        # threads, gave half the table other values in 3 of 16 processes on an Intel Xeon (max 1.5e-4 apart, so
        # greedy outputs changed from process to process); after this small call, 0 of 16 (BENCHMARKS.md,
        # "Fifty-third session")
        self._rotary(probe, torch.arange(2, device=probe.device)[None])
        cos, sin = self._rotary(probe, torch.arange(size, device=probe.device)[None])
        half = self.head_dim // 2
        self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)


@dataclass
class CompiledExact:
    """What the compiled layers' exact attention reads besides each layer's inputs: every layer's key and value
    buffers ``[blocks, slots, head_dim]``, the block and slot each row's key and value go to (for key/value head
    ``h``: block ``write_blocks[r] + h``), and the rows' plan as tensors."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    write_blocks: torch.Tensor
    write_slots: torch.Tensor
    plan: ExactPlan

    def __post_init__(self) -> None:
        self.indptr, self.indices, self.blocks = (torch.from_numpy(a) for a in (
            self.plan.indptr, self.plan.indices, self.plan.blocks))


class Int4Layers:
    """An int4 decoder's two layer halves around attention as one compiled call each
    (:mod:`~hierspec.runtime.int4_kernel`'s ``attention_inputs`` and ``mlp_block``): the same operations as
    :meth:`LlamaFamilyDecoder._attention_inputs` and :meth:`LlamaFamilyDecoder._mlp`, bit for bit, without a
    Python round trip per operation (a SmolLM2 one-token step on an Intel Xeon: BENCHMARKS.md, "Compiled layer
    halves"). Built only where the compiled extension loads; its :attr:`norm` is then the int4 decoder's norm on
    every path."""

    def __init__(self, module, decoder: LlamaFamilyDecoder) -> None:
        self._module = module
        self._decoder = decoder
        #: whether exact-attention forwards run all layers as one call (:meth:`exact_layers`); else the halves
        #: around :mod:`~hierspec.runtime.exact_attention`'s kernel
        self.attends = hasattr(module, "ExactLayerStack")
        self._stack = None  # the layers' weights held by the extension, made at the first exact forward

    @classmethod
    def for_decoder(cls, decoder: LlamaFamilyDecoder) -> Int4Layers | None:
        """The fused halves for ``decoder`` (whose projections are all :class:`Int4Projection`), or ``None`` where the
        compiled extension cannot be built here."""
        module, reason = int4_kernel.compiled_kernel()
        if module is None or any(p.bias is not None for layer in decoder.layers
                                 for p in (layer.out, layer.gate_up, layer.down)):
            log.info("int4 layers run operation by operation: %s", reason or "biased output or MLP projections")
            return None
        return cls(module, decoder)

    def attends_prompts(self, query: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether :meth:`prompt_attention` takes this prompt's queries ``[1, heads, rows, d]`` in ``dtype``: float32
        on the CPU, a head size the kernel's vectors divide, a unit innermost stride."""
        return (dtype == torch.float32 and query.device.type == "cpu" and query.stride(-1) == 1
                and hasattr(self._module, "prompt_attention") and self._module.prompt_attention_fits(query.shape[-1]))

    def prompt_attention(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A prompt's causal attention on an empty cache, ``[rows, heads * d]`` (``prompt_attention.cpp``)."""
        values = values if values.stride(-1) == 1 else values.contiguous()
        return self._module.prompt_attention(query, keys, values, self._decoder.scaling)

    def for_view(self, decoder: LlamaFamilyDecoder) -> Int4Layers:
        """The same compiled halves for another view of this decoder's weights (:meth:`LlamaFamilyDecoder.
        with_row_codes`)."""
        return Int4Layers(self._module, decoder)

    def norm(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The RMS norm of each row (the compiled one, the int4 path's on every call)."""
        return self._module.rms_norm(hidden, weight, eps)

    def attention_inputs(self, layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self._decoder
        return tuple(self._module.attention_inputs(hidden, layer.norm1, d.eps, layer.qkv.native, layer.qkv.bias, cos,
                                                   sin, d.heads, d.kv_heads, d.head_dim))

    def exact_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     compiled: CompiledExact) -> torch.Tensor:
        """Every layer in one call (``ExactLayerStack``, ``int4_attention.cpp``): per layer :meth:`attention_inputs`,
        the rows' keys and values written into that layer's buffers, exact attention over them, :meth:`mlp`. One call
        instead of one per layer, each converting its ~20 arguments: a one-token SmolLM2 forward ~1 ms faster
        (BENCHMARKS.md, "Nineteenth session")."""
        keys, values = zip(*compiled.buffers)
        return self.layer_stack().forward(hidden, cos, sin, list(keys), list(values), compiled.write_blocks,
                                          compiled.write_slots, compiled.indptr, compiled.indices, compiled.blocks)

    def layer_stack(self):
        """The extension's ``ExactLayerStack`` holding every layer's weights (made once, with a helper thread)."""
        if self._stack is None:
            self._stack = self.new_stack(team=True)
        return self._stack

    def new_stack(self, team: bool):
        """A new ``ExactLayerStack`` over every layer's weights; ``team``: forwards of few rows over integer products
        on two threads keep both for the whole stack (``int4_team.h``), the same bits either way."""
        d = self._decoder
        stack = self._module.ExactLayerStack(d.eps, d.scaling, d.heads, d.kv_heads, d.head_dim, team)
        for layer in d.layers:
            stack.add(layer.norm1, layer.qkv.native, layer.qkv.bias, layer.norm2, layer.out.native,
                      layer.gate_up.native, layer.down.native, layer.gate_up.widths[0])
        return stack

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` (the compiled one: the int4 path's on every call)."""
        return self._module.silu_product(gate, up)

    def mlp(self, layer: _Layer, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return self._module.mlp_block(hidden, attended, layer.norm2, self._decoder.eps, layer.out.native,
                                      layer.gate_up.native, layer.down.native, layer.gate_up.widths[0])


@dataclass(frozen=True)
class _PromptGlue:
    """The compiled glue of the int4 path's expanded prompt decoder (``prompt_norm``, ``prompt_qkv``,
    ``prompt_add_norm``, ``prompt_activation`` in ``int4_blocks.cpp``): between its products each run of a layer's
    small tensor operations is one call — ~25 fewer calls a layer. Its arithmetic is the int4 path's (compiled
    norm, rotation and activation; each result rounded once to ``dtype``), not PyTorch's operation for operation:
    only a decoder whose products are in a narrower dtype than its float32 rows takes it (the expanded prompt
    decoder of the int4 path)."""

    module: object
    dtype: torch.dtype

    @staticmethod
    def for_decoder(decoder: LlamaFamilyDecoder, product_dtype: torch.dtype | None) -> _PromptGlue | None:
        """The glue for ``decoder`` where its products are one packed ``product_dtype`` product per projection, bias
        free but for q/k/v, its rows float32 on the CPU and the compiled extension built here (the int4 path, the
        only one that makes such a decoder, has asked for it first); else ``None``."""
        if (product_dtype is None or decoder.embedding.dtype != torch.float32
                or decoder.embedding.device.type != "cpu"):
            return None  # before asking for the extension: no other path ever builds it
        module, _ = int4_kernel.compiled_kernel()
        if module is None or not hasattr(module, "prompt_qkv"):
            return None
        for layer in decoder.layers:
            projections = (layer.qkv, layer.out, layer.gate_up, layer.down)
            if not all(isinstance(p, Projection) and p.packed and p.product_dtype == product_dtype
                       for p in projections) or any(p.bias is not None for p in projections[1:]):
                return None
        return _PromptGlue(module, product_dtype)


def _head_passes(quantized: Mapping[str, Sequence[Int4Weight]], name: str) -> Callable[[], Sequence[Int4Weight]]:
    """The head's passes when a head over some tokens asks for them: read from the cache file then where the
    weights come from one (:class:`~hierspec.runtime.quantized.CachedWeights`), else the ones already in memory."""
    if isinstance(quantized, CachedWeights):
        return lambda: quantized[name]
    passes = quantized[name]
    return lambda: passes


def _stacked(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The weights one below the other in ``dtype``, a new tensor, each converted as it is copied in (one pass over
    the weights: converting then concatenating read and wrote Qwen2.5-Coder-1.5B's 6 GB of them twice at load)."""
    stacked = weights[0].new_empty((sum(w.shape[0] for w in weights), weights[0].shape[1]), dtype=dtype)
    start = 0
    for weight in weights:
        stacked[start : start + weight.shape[0]].copy_(weight)
        start += weight.shape[0]
    return stacked


def _int64(values: np.ndarray) -> np.ndarray:
    """``values`` as a writable C-contiguous int64 array (itself when it is one: a tree's arrays are)."""
    if values.dtype == np.int64 and values.flags.c_contiguous and values.flags.writeable:
        return values
    return np.array(values, dtype=np.int64)


def _silu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """transformers' Llama MLP activation, ``silu(gate) * up``."""
    return F.silu(gate) * up


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, operation for operation (in float32 for lower precisions)."""
    dtype = hidden.dtype
    wide = hidden.to(torch.float32)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(dtype)


def _rotate(states: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor, ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = cat(-x2, x1)``: computed as ``cat(x2, x1) * cat(-sin1, sin2)``, which is the same product
    bit for bit (a sign moves between the factors) without negating ``x``."""
    half = states.shape[-1] // 2
    return (states * cos) + (states.roll(half, -1) * signed_sin)


def build_decoder(model: nn.Module, packed: bool,
                  quantized: Mapping[str, Sequence[Int4Weight]] | None = None,
                  product_dtype: torch.dtype | None = None,
                  int4_kernel: Int4Kernels | None = None,
                  packs: PackedStore | None = None,
                  dense_dtype: torch.dtype | None = None, dense_kernel: str = "onednn") -> LlamaFamilyDecoder | None:
    """The owned forward for ``model`` (its linears from ``quantized`` passes where given, or their products in
    ``product_dtype`` — see :class:`Projection`, or the compiled layers over its weights packed in ``dense_dtype``
    for ``dense_kernel`` — see :func:`_dense_projection`), or ``None`` (with the reason logged) where transformers'
    modules must run."""
    reason = unsupported_reason(model)
    if reason is not None:
        log.info("transformers' decoder modules run: %s", reason)
        return None
    return LlamaFamilyDecoder(model, packed, quantized, product_dtype, int4_kernel, packs, dense_dtype, dense_kernel)


def _dense_projection(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                      dtype: torch.dtype, kernel: str = "onednn") -> Int4Projection:
    """Linears of float weights as the compiled layers multiply them: one stack of the weights in ``dtype``, packed
    for ``kernel`` (:func:`~hierspec.runtime.dense_kernel.dense_stack`: oneDNN's prepacked copy, or the dot
    products' where they fit), float32 rows and outputs, float32 biases added."""
    stack = dense_stack(weights, _stacked([w.detach() for w in weights], dtype), kernel)
    return Int4Projection(None, biases, widths=[w.shape[0] for w in weights], stacks=[stack])


def _whole_blocks(tokens: torch.Tensor, block: int) -> torch.Tensor:
    """``tokens`` with the last one repeated up to a whole number of ``block`` outputs (the int4 layouts and the dot
    products' hold whole blocks of 16; the repeats' columns are cut off again)."""
    return torch.cat((tokens, tokens[-1:].expand(-tokens.numel() % block)))


def _rows_of(bias: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor | None:
    return None if bias is None else bias[tokens]


def _float_weight(weight: torch.Tensor, dense_dtype: torch.dtype | None) -> torch.Tensor:
    """A norm's weight as the decoder reads it: in float32 for the compiled layers over float weights (whose rows
    are float32), as loaded otherwise."""
    return weight.detach().float() if dense_dtype is not None else weight.detach()


def unsupported_reason(model: nn.Module) -> str | None:
    """Why :class:`LlamaFamilyDecoder` cannot run ``model``, or ``None`` when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb"):
        return "the model does not have the Llama family's module layout"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rotary type {rope_type!r} depends on the sequence length"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        return "sliding-window attention"
    attention, mlp = layers[0].self_attn, layers[0].mlp
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"):
        if not hasattr(attention, name):
            return f"the attention module has no {name}"
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not hasattr(mlp, name):
            return f"the MLP module has no {name}"
    if getattr(inner, "embed_scale", None) is not None:
        return "a scaled embedding"
    return None
