"""Fewer kernels a layer on CUDA graphs: fused norms, rotary embedding, projections and SiLU for Llama-family models.

A graphed forward of SmolLM2-135M on an H200 is ~1,250 kernels of ~2.5 µs each, its GPU time equal to its wall time
(``scripts/cuda_forward_profile.py``, BENCHMARKS.md): transformers' modules run each RMS norm as seven elementwise
and reduction kernels, the rotary embedding of queries and keys as ten, and every projection separately. Here, per
decoder layer of a Llama-family model (:func:`hierspec.runtime.decoder.unsupported_reason` says which):

* each RMS norm (and the model's final one) is one Triton program a row, the whole row's sum of squares in one
  reduction of a fixed shape — so a row's bits never depend on the rows beside it;
* the attention's query, key and value products are one product over their weights concatenated (a non-persistent
  buffer of the module; the three ``Linear`` weights become views of it: no second copy), and the rotary embedding
  of queries and keys is one kernel, one program per (row, head), in float32 with one rounding;
* the MLP's gate and up products are one product, and SiLU(gate) x up one kernel.

On an H200 a one-token forward of SmolLM2 went from 1,253 kernels and 3.1 ms to 436 and 1.6 ms (BENCHMARKS.md,
"Sixty-ninth session"). Each module's ``forward`` is replaced on the instance (other models in the process keep
theirs; :meth:`FusedLayers.stock` takes them off for transformers' own ``generate``); the attention forward mirrors
transformers' Llama/Qwen2/Mistral attention (projections, rotary, ``cache.update``, the registered attention
function, output projection), the one place here that follows transformers' internals: ``tests/test_cuda_fusion.py``
checks it against the stock forward on each supported architecture, so a transformers change fails loudly there.
Every method runs the same fused forward, plain decoding included, so outputs stay identical to ``ar``; the fused
forward's logits differ from transformers' in the last bits (one rounding where transformers rounds after each op).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import MethodType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hierspec.runtime.cuda_attention import triton_unavailable
from hierspec.runtime.decoder import unsupported_reason

try:  # Triton ships with PyTorch's CUDA builds; CPU-only builds come without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the PyTorch build
    triton = None


@dataclass(frozen=True)
class FusedOps:
    """The three fused operations: ``rms_norm(x, weight, eps)``, ``rotary(q, k, cos, sin) -> (q, k)`` and
    ``silu_mul(gate_up) -> silu(gate) * up`` (``gate_up`` holds gate then up in its last dimension)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


def unavailable(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused layers cannot run ``model`` (``None`` when they can)."""
    return triton_unavailable(device, dtype, "fused layers") or unsupported_reason(model)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reference computes in: float32, or float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What the norm kernel computes, with PyTorch's operations: the row normalised in float32 (as transformers
    does, whatever the dtype) and rounded to the input's dtype, times the weight in float32 (float64 for a float64
    input), rounded once."""
    wide = _wide(x.dtype)
    row = x.to(torch.float32)
    normed = (row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.to(wide) * normed.to(wide)).to(x.dtype)


def reference_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """What the rotary kernel computes: ``x * cos + rotate_half(x) * sin`` with one rounding."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        wide = _wide(x.dtype)
        half = x.shape[-1] // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1).to(wide)
        return (x.to(wide) * cos.unsqueeze(1).to(wide) + turned * sin.unsqueeze(1).to(wide)).to(x.dtype)

    return rotate(q), rotate(k)


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """What the SiLU kernel computes: ``silu(gate) * up`` with one rounding."""
    wide = _wide(gate_up.dtype)
    gate, up = gate_up.to(wide).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


#: the operations with PyTorch's, for tests on the CPU (the kernels' reference)
REFERENCE_OPS = FusedOps(reference_rms_norm, reference_rotary, reference_silu_mul)


class FusedLayers:
    """The fused forwards installed on a model's modules; :meth:`stock` takes them off again (transformers' own
    ``generate`` as a benchmark peer runs the modules as transformers wrote them), :meth:`fused` puts them back."""

    def __init__(self) -> None:
        self._forwards: list[tuple[nn.Module, MethodType]] = []

    def add(self, module: nn.Module, forward) -> None:
        """Replace ``module``'s forward by ``forward`` (bound to it) on the instance."""
        bound = MethodType(forward, module)
        module.forward = bound
        self._forwards.append((module, bound))

    def stock(self) -> None:
        """Every module back on its class's forward (the weights stay views of the concatenated tensors)."""
        for module, _ in self._forwards:
            vars(module).pop("forward", None)

    def fused(self) -> None:
        """The fused forwards on again."""
        for module, bound in self._forwards:
            module.forward = bound


def install(model: nn.Module, ops: FusedOps | None = None) -> FusedLayers:
    """Replace the forwards of ``model``'s norms, attention and MLP modules by the fused ones (Triton kernels, or
    ``ops``); the q/k/v and gate/up weights become views of one concatenated tensor each (a non-persistent buffer of
    the attention or MLP module). A model fused before is left as it is (its :class:`FusedLayers` returned)."""
    done = getattr(model, "_hierspec_fused_layers", None)
    if done is not None:
        return done
    ops = ops or TRITON_OPS
    fused = FusedLayers()
    inner = model.model
    for layer in inner.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            _fuse_norm(fused, norm, ops)
        _fuse_attention(fused, layer.self_attn, ops)
        _fuse_mlp(fused, layer.mlp, ops)
    _fuse_norm(fused, inner.norm, ops)
    model._hierspec_fused_layers = fused
    return fused


def _concatenate(module: nn.Module, name: str, linears: list[nn.Linear]) -> None:
    """``linears`` side by side as one weight (and bias) kept as ``module``'s non-persistent buffers ``name`` and
    ``name + "_bias"`` (so ``module.to(...)`` moves them too); each linear's own parameters become views of them."""
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        has_bias = any(linear.bias is not None for linear in linears)
        bias = torch.cat([linear.bias if linear.bias is not None else weight.new_zeros(linear.out_features)
                          for linear in linears]) if has_bias else None
    start = 0
    for linear in linears:
        stop = start + linear.out_features
        linear.weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(bias[start:stop], requires_grad=False)
        start = stop
    module.register_buffer(name, weight, persistent=False)
    module.register_buffer(name + "_bias", bias, persistent=False)


def _fuse_norm(fused: FusedLayers, norm: nn.Module, ops: FusedOps) -> None:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)

    fused.add(norm, forward)


def _fuse_mlp(fused: FusedLayers, mlp: nn.Module, ops: FusedOps) -> None:
    _concatenate(mlp, "hierspec_gate_up", [mlp.gate_proj, mlp.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(F.linear(x, self.hierspec_gate_up)))

    fused.add(mlp, forward)


def _fuse_attention(fused: FusedLayers, attention: nn.Module, ops: FusedOps) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _concatenate(attention, "hierspec_qkv", [attention.q_proj, attention.k_proj, attention.v_proj])
    queries, keys = attention.q_proj.out_features, attention.k_proj.out_features
    extra = {"sliding_window": attention.sliding_window} if hasattr(attention, "sliding_window") else {}
    eager = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        shape = hidden_states.shape[:-1]
        qkv = F.linear(hidden_states, self.hierspec_qkv, self.hierspec_qkv_bias)
        query = qkv[..., :queries].view(*shape, -1, self.head_dim).transpose(1, 2)
        key = qkv[..., queries : queries + keys].view(*shape, -1, self.head_dim).transpose(1, 2)
        value = qkv[..., queries + keys :].view(*shape, -1, self.head_dim).transpose(1, 2)
        query, key = ops.rotary(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
        out, weights = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **extra,
                              **kwargs)
        return self.o_proj(out.reshape(*shape, -1).contiguous()), weights

    fused.add(attention, forward)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dimension, one program a row (the Triton kernel)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    width = rows.shape[1]
    _rms_norm_rows[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), width, float(eps),
                                     BLOCK=triton.next_power_of_2(width), num_warps=4)
    return out.view(x.shape)


def triton_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding of ``q`` and ``k`` (``[batch, heads, rows, d]`` views) by ``cos``/``sin`` (``[batch, rows,
    d]``), one program per (sequence and row, head); outputs laid out as ``[batch, rows, heads, d]`` transposed, as
    transformers' are."""
    batch, heads, rows, dim = q.shape
    kv_heads = k.shape[1]
    # one table for every sequence of a batch reads with a batch stride of 0; the kernel reads the last dimension
    # of every input contiguously
    cos, sin = (table.expand(batch, -1, -1) if table.stride(-1) == 1 else table.contiguous().expand(batch, -1, -1)
                for table in (cos, sin))
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    q_out = torch.empty((batch, rows, heads, dim), dtype=q.dtype, device=q.device).transpose(1, 2)
    k_out = torch.empty((batch, rows, kv_heads, dim), dtype=k.dtype, device=k.device).transpose(1, 2)
    _rotary_rows[(batch * rows, heads + kv_heads)](
        q, k, cos, sin, q_out, k_out, rows, heads, *q.stride()[:3], *k.stride()[:3], *cos.stride()[:2],
        *sin.stride()[:2], *q_out.stride()[:3], *k_out.stride()[:3], HALF=dim // 2,
        HALF_PAD=triton.next_power_of_2(dim // 2), num_warps=1)
    return q_out, k_out


def triton_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[..., 2 I]`` tensor (gate first), one kernel."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    width = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_rows[(rows.shape[0], triton.cdiv(width, block))](rows, out, rows.stride(0), width, BLOCK=block,
                                                                num_warps=4)
    return out.view(*gate_up.shape[:-1], width)


TRITON_OPS = FusedOps(triton_rms_norm, triton_rotary, triton_silu_mul)

if triton is not None:
    @triton.jit(do_not_specialize=["stride", "out_stride", "eps"])
    def _rms_norm_rows(x_ptr, w_ptr, out_ptr, stride, out_stride, width, eps,
                       BLOCK: tl.constexpr):  # pragma: no cover - runs on a GPU
        """One row: ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32, the normalised row rounded first."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        live = cols < width
        x = tl.load(x_ptr + row * stride + cols, mask=live, other=0.0).to(tl.float32)
        normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)).to(out_ptr.dtype.element_ty)
        weight = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols,
                 (weight * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _rotate(src, dst, c1, c2, s1, s2, HALF: tl.constexpr, HALF_PAD: tl.constexpr):  # pragma: no cover - GPU
        """``x * cos + rotate_half(x) * sin`` of one head's row at ``src``, stored at ``dst``."""
        lanes = tl.arange(0, HALF_PAD)
        live = lanes < HALF
        x1 = tl.load(src + lanes, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + lanes, mask=live, other=0.0).to(tl.float32)
        tl.store(dst + lanes, (x1 * c1 - x2 * s1).to(dst.dtype.element_ty), mask=live)
        tl.store(dst + HALF + lanes, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=live)

    @triton.jit(do_not_specialize=["rows", "heads", "q_seq", "q_head", "q_row", "k_seq", "k_head", "k_row", "cos_seq",
                                   "cos_row", "sin_seq", "sin_row", "qo_seq", "qo_head", "qo_row", "ko_seq",
                                   "ko_head", "ko_row"])
    def _rotary_rows(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, rows, heads, q_seq, q_head, q_row, k_seq, k_head,
                     k_row, cos_seq, cos_row, sin_seq, sin_row, qo_seq, qo_head, qo_row, ko_seq, ko_head, ko_row,
                     HALF: tl.constexpr, HALF_PAD: tl.constexpr):  # pragma: no cover - runs on a GPU
        """One (sequence and row, head) of the queries (heads first) or keys."""
        seq = tl.program_id(0) // rows
        row = tl.program_id(0) % rows
        head = tl.program_id(1)
        lanes = tl.arange(0, HALF_PAD)
        live = lanes < HALF
        cos = cos_ptr + seq * cos_seq + row * cos_row
        sin = sin_ptr + seq * sin_seq + row * sin_row
        c1 = tl.load(cos + lanes, mask=live, other=0.0).to(tl.float32)
        c2 = tl.load(cos + HALF + lanes, mask=live, other=0.0).to(tl.float32)
        s1 = tl.load(sin + lanes, mask=live, other=0.0).to(tl.float32)
        s2 = tl.load(sin + HALF + lanes, mask=live, other=0.0).to(tl.float32)
        if head < heads:
            _rotate(q_ptr + seq * q_seq + head * q_head + row * q_row,
                    qo_ptr + seq * qo_seq + head * qo_head + row * qo_row, c1, c2, s1, s2, HALF, HALF_PAD)
        else:
            kv_head = head - heads
            _rotate(k_ptr + seq * k_seq + kv_head * k_head + row * k_row,
                    ko_ptr + seq * ko_seq + kv_head * ko_head + row * ko_row, c1, c2, s1, s2, HALF, HALF_PAD)

    @triton.jit(do_not_specialize=["stride", "width"])
    def _silu_mul_rows(x_ptr, out_ptr, stride, width, BLOCK: tl.constexpr):  # pragma: no cover - runs on a GPU
        """One block of one row: ``silu(gate) * up`` in float32."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < width
        gate = tl.load(x_ptr + row * stride + cols, mask=live, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride + width + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
                 mask=live)
