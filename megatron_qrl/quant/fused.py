"""Which implementation quantizes: the format's fused Triton kernel or its torch code.

A format names its fused kernels on its class, beside its reference code: ``fused_kernel``
(the weight quantizer, a function of :mod:`.triton_quant`;
:meth:`~megatron_qrl.quant.spec_core.SpecCore.quantize_weight` consults :func:`fused_kernel`
first), and for the W8A8 per-token formats ``fused_act_kernel`` (``quantize_activation``) and
``fused_dequant_kernel`` (the per-row dequantization of the aligned forward's operands),
for per-token-group formats ``fused_group_act_kernel`` (the fake path's activation groups),
functions of :mod:`.triton_act`; ``fused_fake_kernel`` (the weight's fake quantization,
:meth:`~megatron_qrl.quant.spec_core.SpecCore.quantize_dequantize`: the aligned forward's
refresh), a function of :mod:`.triton_fake`; None where it has none. Both give the same bits
(``tests/gpu/test_fused_quant.py``). One choice covers all of them:

``auto`` / ``torch`` / ``triton`` (:mod:`megatron_qrl.utils.kernel_choice`; A/B benchmarks:
``bench/pack_profile.py --quant-impl``, ``bench/aligned_step.py --real-torch-operands``), set
by the environment variable :data:`ENV` or :func:`set_quant_impl` (which wins).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from megatron_qrl.utils import kernel_choice

ENV = "QRL_QUANT_IMPL"
IMPLS = kernel_choice.IMPLS

KERNEL_MODULES = {"fused_kernel": "triton_quant", "fused_into_kernel": "triton_quant",
                  "fused_act_kernel": "triton_act",
                  "fused_dequant_kernel": "triton_act", "fused_group_act_kernel": "triton_act",
                  "fused_fake_kernel": "triton_fake"}
"""A format's kernel attribute -> the module (in this package) holding the kernels it names."""

_SETTING = kernel_choice.ImplSetting(ENV, "quantizer")


def set_quant_impl(impl: str | None) -> None:
    """Choose the implementation for this process (None: back to :data:`ENV`, else auto)."""
    _SETTING.set(impl, "set_quant_impl")


def quant_impl() -> str:
    """The implementation in force: :func:`set_quant_impl`'s, else :data:`ENV`'s, else auto."""
    return _SETTING.get()


@functools.cache
def kernels(module: str = "triton_quant") -> ModuleType | None:
    """:mod:`.triton_quant` (or ``module``), or None where Triton does not import."""
    return kernel_choice.import_kernels(f"megatron_qrl.quant.{module}")


def fused_kernel(spec, device: torch.device, attr: str = "fused_kernel") -> Callable | None:
    """The fused kernel ``spec.<attr>`` (default: the weight quantizer) for a tensor on
    ``device``, or None (use the torch reference). Raises, naming the fix, where ``triton`` is
    forced but cannot run."""
    name = getattr(spec, attr, None)
    if name is None:
        return None
    mod = module_kernels(KERNEL_MODULES[attr], device, "the tensor is on {device}")
    return None if mod is None else getattr(mod, name)


def module_kernels(module: str, device: torch.device, where: str) -> ModuleType | None:
    """The fused kernels' module ``module`` of this package for tensors on ``device`` under the
    choice in force, or None (the torch code); ``where`` as in
    :func:`~megatron_qrl.utils.kernel_choice.select_kernels`. For kernels no format names (the
    FP8 backward's gradient quantizers, :mod:`.triton_grad`)."""
    return kernel_choice.select_kernels(quant_impl(), kernels(module), device, ENV, where)
