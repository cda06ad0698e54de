"""Quantize a weight straight into tensors another component owns (an engine's live parameters).

:meth:`~megatron_qrl.quant.spec_core.SpecCore.quantize_into` gives the same bits as
:meth:`~megatron_qrl.quant.spec_core.SpecCore.pack` — codes and scales — but writes them
into the regions ``region(packed_name, shape, dtype)`` hands out (views of someone else's
storage, any strides: a fused ``qkv_proj``'s rows, one half of every expert's ``w13``), so no
packed tensor of the weight is made and nothing is copied a second time. A weight is
``[out, in]``, or an expert stack ``[E, out, in]`` under a stacked name
(``...experts.*.gate_proj.weight``, :data:`~megatron_qrl.utils.hf_names.STACKED`), each expert
quantized on its own (its own scales, its own partial edge block).

The formats that implement it (``_quantize_into``: the per-channel ``fp8`` / ``int8`` and the
128x128-block ``fp8_block``) first reduce the scales' amaxes (one read of the weight), write
the scales, then write the codes by elementwise ops whose output is the region: ``fp8``
codes by one ``torch.mul(w, s, out=codes)`` (the fp32 product cast to E4M3 on store),
``int8`` codes through an fp32 product rounded in chunks of :data:`CHUNK_ELEMENTS`. The
scales come from the same expressions as the format's ``_quantize`` (its helpers), the
products are the same fp32 products, and a cast or round of the same fp32 value is the same
code: bit for bit :meth:`pack`'s tensors (``tests/quant/test_quantize_into.py``).

Where the format names a fused kernel for it (``fused_into_kernel``: fp8 / int8,
:func:`~megatron_qrl.quant.triton_quant.quantize_channel_into`; fp8_block,
:func:`~megatron_qrl.quant.triton_quant.quantize_fp8_block_into`) and it runs
(:func:`~megatron_qrl.quant.fused.fused_kernel`: CUDA tensors with Triton), one launch per
weight or expert stack computes the amaxes, writes the scales and the codes into their regions
(any row strides; the codes' rows contiguous, as every engine region is), the same bits
(``tests/quant/test_fused_into.py``); the torch code above stays the reference and the CPU path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..utils import hf_names
from .finite_checks import FiniteChecks
from .fused import fused_kernel

__all__ = ["CHUNK_ELEMENTS", "Region", "quantize_into", "row_chunks"]

Region = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
"""``(packed name, shape, dtype) -> `` the tensor that packed tensor is written into (raises
where there is no such region)."""

CHUNK_ELEMENTS = 1 << 24
"""Elements of one fp32 temporary where a format's codes need one (int8's rounding): 64 MiB."""

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def quantize_into(spec, hf_name: str, w: torch.Tensor, region: Region,
                  finite: FiniteChecks | None = None) -> list[tuple[str, torch.Tensor]]:
    """Quantize weight ``hf_name`` (or an expert stack) into ``region``'s tensors (module
    docstring); returns ``(packed name, region written)`` for the codes, then the scales.

    The weight's finiteness is checked on the amaxes the format reduced anyway, after the
    write: now (a non-finite weight raises naming it; its regions hold what it gave), or,
    with ``finite``, recorded there under ``hf_name`` as device bools for
    :meth:`FiniteChecks.check <.finite_checks.FiniteChecks.check>` to check all at once (one
    host sync per sync instead of one per weight; the same error)."""
    p = hf_names.parse(hf_name)
    stacked = p is not None and p.is_stacked
    unit = hf_names.expert_name(hf_name, 0) if stacked else hf_name
    if not spec.is_quantized(unit):
        raise ValueError(f"{spec.name}: {hf_name} is not a weight this format quantizes")
    want = 3 if stacked else 2
    if not isinstance(w, torch.Tensor) or w.dim() != want:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{spec.name}: {hf_name} must be a {want}-D "
                         f"{'[E, out, in] expert stack' if stacked else '[out, in] tensor'}, "
                         f"got {shape}")
    if w.dtype not in _FLOATS:
        raise TypeError(f"{spec.name}: {hf_name} has dtype {w.dtype}; expected fp32/bf16/fp16")
    spec._check_shape(tuple(w.shape[-2:]), hf_name)
    scale_shape = tuple(w.shape[:-2]) + spec._scale_shape(*w.shape[-2:])  # (or: not served)
    stem = hf_name[: -len(".weight")]
    codes_name, scale_name = (f"{stem}.{suffix}" for suffix in spec._packed_suffixes())
    codes = region(codes_name, tuple(w.shape), getattr(torch, spec.weight_format))
    scale = region(scale_name, scale_shape, torch.float32)
    w3 = w.detach() if stacked else w.detach().unsqueeze(0)
    c3, s3 = (codes, scale) if stacked else (codes.unsqueeze(0), scale.unsqueeze(0))
    kernel = fused_kernel(spec, w.device, "fused_into_kernel") if w.numel() else None
    with torch.no_grad():
        if kernel is not None and (c3.stride(-1) == 1 or c3.shape[-1] == 1):
            a = kernel(spec, w3, c3, s3)
        else:
            a = spec._quantize_into(w3, c3, s3)
    if finite is not None:  # (``a`` is this call's own: checked with the stream's others)
        finite.add_amax(hf_name, a)
    else:
        spec._check_finite_amax(a, w, hf_name)
    return [(codes_name, codes), (scale_name, scale)]


def row_chunks(shape: torch.Size | tuple[int, ...], limit: int = CHUNK_ELEMENTS
               ) -> Iterator[tuple[slice, slice]]:
    """``(experts, rows)`` slices of an ``[E, rows, k]`` tensor, each at most ``limit``
    elements (at least one row): the pieces a format's fp32 temporary covers one at a time."""
    e, n, k = shape
    per = max(1, limit // max(k, 1))
    if per >= n:  # whole experts per chunk
        step = max(1, per // max(n, 1))
        for e0 in range(0, e, step):
            yield slice(e0, min(e0 + step, e)), slice(0, n)
        return
    for e0 in range(e):
        for r0 in range(0, n, per):
            yield slice(e0, e0 + 1), slice(r0, min(r0 + per, n))
