"""Which implementation quantizes a weight: the format's fused Triton kernel or its torch code.

A format names its fused quantizer on its class (``fused_kernel``, a function of
:mod:`.triton_quant`; None where it has none), beside its reference quantizer
(:meth:`~megatron_qrl.quant.spec_core.SpecCore.quantize_weight` consults :func:`fused_kernel`
first). Both give the same bits (``tests/gpu/test_fused_quant.py``). The choice:

``auto`` / ``torch`` / ``triton`` (:mod:`megatron_qrl.utils.kernel_choice`; A/B benchmarks:
``bench/pack_profile.py --quant-impl``), set by the environment variable :data:`ENV` or
:func:`set_quant_impl` (which wins).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from megatron_qrl.utils import kernel_choice

ENV = "QRL_QUANT_IMPL"
IMPLS = kernel_choice.IMPLS

_SETTING = kernel_choice.ImplSetting(ENV, "quantizer")


def set_quant_impl(impl: str | None) -> None:
    """Choose the implementation for this process (None: back to :data:`ENV`, else auto)."""
    _SETTING.set(impl, "set_quant_impl")


def quant_impl() -> str:
    """The implementation in force: :func:`set_quant_impl`'s, else :data:`ENV`'s, else auto."""
    return _SETTING.get()


@functools.cache
def kernels() -> ModuleType | None:
    """:mod:`.triton_quant`, or None where Triton does not import."""
    return kernel_choice.import_kernels("megatron_qrl.quant.triton_quant")


def fused_kernel(spec, device: torch.device) -> Callable | None:
    """The fused quantizer of format ``spec`` for a weight on ``device``, or None (use the
    torch reference). Raises, naming the fix, where ``triton`` is forced but cannot run."""
    name = getattr(spec, "fused_kernel", None)
    if name is None:
        return None
    mod = kernel_choice.select_kernels(quant_impl(), kernels(), device, ENV,
                                       "the weight is on {device}")
    return None if mod is None else getattr(mod, name)
