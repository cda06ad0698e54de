"""Which implementation quantizes a weight: the format's fused Triton kernel or its torch code.

A format names its fused quantizer on its class (``fused_kernel``, a function of
:mod:`.triton_quant`; None where it has none), beside its reference quantizer
(:meth:`~megatron_qrl.quant.spec_core.SpecCore.quantize_weight` consults :func:`fused_kernel`
first). Both give the same bits (``tests/gpu/test_fused_quant.py``). The choice:

- ``auto`` (default): the kernel for a CUDA weight when Triton imports, else torch (CPU CI);
- ``torch``: always the reference code (A/B benchmarks: ``bench/pack_profile.py --quant-impl``);
- ``triton``: always the kernel; an error where Triton or a GPU is missing (CPU tensors go
  through Triton's interpreter only under ``TRITON_INTERPRET=1``, the tests' mode).

Set by the environment variable :data:`ENV` or :func:`set_quant_impl` (which wins).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType

import torch

ENV = "QRL_QUANT_IMPL"
IMPLS = ("auto", "torch", "triton")

_forced: list[str] = []


def set_quant_impl(impl: str | None) -> None:
    """Choose the implementation for this process (None: back to :data:`ENV`, else auto)."""
    if impl is not None:
        _check(impl, "set_quant_impl")
    _forced[:] = [] if impl is None else [impl]


def quant_impl() -> str:
    """The implementation in force: :func:`set_quant_impl`'s, else :data:`ENV`'s, else auto."""
    if _forced:
        return _forced[0]
    return _check(os.environ.get(ENV, "auto"), ENV)


def _check(impl: str, where: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"{where}={impl!r} is not a quantizer implementation; use one of "
                         f"{', '.join(IMPLS)}")
    return impl


@functools.cache
def kernels() -> ModuleType | None:
    """:mod:`.triton_quant`, or None where Triton does not import."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from . import triton_quant

    return triton_quant


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_kernel(spec, device: torch.device) -> Callable | None:
    """The fused quantizer of format ``spec`` for a weight on ``device``, or None (use the
    torch reference). Raises, naming the fix, where ``triton`` is forced but cannot run."""
    name = getattr(spec, "fused_kernel", None)
    impl = quant_impl()
    if name is None or impl == "torch":
        return None
    mod = kernels()
    runs_here = torch.device(device).type == "cuda" or (impl == "triton" and _interpreted())
    if mod is not None and runs_here:
        return getattr(mod, name)
    if impl == "triton":
        why = "Triton is not installed" if mod is None else f"the weight is on {device}"
        raise RuntimeError(f"{ENV}=triton (--quant-impl triton): {why}; the fused {spec.name} "
                           "quantizer needs Triton and a CUDA weight; use auto or torch")
    return None
