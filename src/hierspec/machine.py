"""What this CPU can do: its name, the vector instruction sets that decide which kernels are fast, and whether it
computes bfloat16 natively.

The project's machines vary from session to session (the same "AMD EPYC" may have AVX-512 with BF16 or AVX2 only), so
benchmarks name the CPU and its flags, cost curves are cached per CPU, and bfloat16 on a CPU that only emulates it is
called out at load.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from hierspec.runtime.onednn import native_bfloat16

#: the flags that change which kernels are fast, in the order they are reported
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's model name, its kernel-relevant flags, PyTorch's vector capability and native bfloat16 support."""

    model: str
    flags: tuple[str, ...]
    capability: str
    native_bf16: bool

    def describe(self) -> str:
        """One line for benchmark tables, e.g. ``AMD EPYC 9R14 (avx2 fma avx512f avx512_bf16; torch AVX512)``."""
        return f"{self.model} ({' '.join(self.flags) or 'no AVX2'}; torch {self.capability})"


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """The first ``model name`` and the kernel flags from ``/proc/cpuinfo`` text.

    Example: ``parse_cpuinfo("model name : AMD EPYC\\nflags : fpu avx2 fma")`` is ``("AMD EPYC", ("avx2", "fma"))``.
    """
    model, flags = cpuinfo_fields(text)
    return model, tuple(flag for flag in KERNEL_FLAGS if flag in flags)


def cpuinfo_fields(text: str) -> tuple[str, frozenset[str]]:
    """The first ``model name`` and the first CPU's whole flag set from ``/proc/cpuinfo`` text."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """This machine's :class:`CpuInfo` (read once)."""
    try:
        model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace"))
    except OSError:
        model, flags = "", ()
    model = model or platform.processor() or platform.machine()
    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        capability = "unknown"
    return CpuInfo(model=model, flags=flags, capability=capability, native_bf16=native_bfloat16())


def gpu_name(device: torch.device) -> str | None:
    """The name of a CUDA ``device`` (``NVIDIA H200``, say); ``None`` for any other device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
