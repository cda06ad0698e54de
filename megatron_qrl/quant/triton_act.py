"""Fused Triton kernels of the real low-bit GEMM's operands: per-token activation quantization
and per-row dequantization, each one kernel where the torch reference runs five to ten.

- :func:`quantize_act_per_token`: ``(codes, scale)`` of the W8A8 formats' dynamic per-token
  activation quantization (``QuantSpec.quantize_activation``; the rollout engine's
  ``sgl_per_token_quant_fp8`` / ``per_token_quant_int8`` numerics, see
  :mod:`megatron_qrl.quant.formats.channel`), reading ``x`` in its own dtype (BF16) instead of
  an fp32 copy: one pass for the token's amax, one (from L2) for the codes.
- :func:`quantize_act_per_token_group`: the same for fp8_block's 1x128 activation groups
  (SGLang's ``per_token_group_quant_fp8`` numerics), the fake path's activation quantizer of
  the experts (fp8_block's real GEMM has no grouped-experts form) in one kernel instead of ten
  torch passes over an fp32 copy.
- :func:`dequantize_rows`: ``(codes.float() * scale).to(dtype)`` for a per-row fp32 scale
  (the straight-through backward's ``deq Q_w(W)`` and ``deq Q_a(x)``): reads one byte per
  element and writes the output, no fp32 intermediates.

Bit for bit the torch reference on the device the tensors are on, which is not the same
arithmetic everywhere: torch divides a CUDA tensor by a Python scalar as ``a * fl(1 / b)``
(ATen ``div_true_kernel_cuda``: "compute a * reciprocal(b)", the reciprocal rounded to fp32
on the host) and a CPU tensor by IEEE division, so the scale ``amax / 448`` (fp8) or
``amax / 127`` (int8) is computed as that device's torch computes it (``CUDA_DIV``, asked of
torch once per device type: :func:`torch_divides_by_reciprocal`). Every
other step is the same on both: ``1 / s`` and ``127 / a`` are ``reciprocal`` (IEEE division,
then the multiply), the E4M3 cast and the int8 round (``sign(v) * floor(|v| + 0.5)``, half
away from zero) as in :mod:`.triton_quant`. ``tests/quant/test_fused_act.py`` (interpreter)
and ``tests/gpu/test_fused_quant.py`` (compiled) hold them to the reference. fp8 is bit-exact
on non-finite tokens too (an inf makes the token's scale inf and its codes 0 or NaN, a NaN its
scale NaN and its codes NaN), except for the sign of a NaN code from ``NaN * NaN``, which is
the operand order the compiler chose; int8 codes of a non-finite token are undefined in torch
and here.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from .numerics import FP8_E4M3_MAX
from .triton_quant import _SOFT, _bf16_rne, _e4m3, _on, _pow2, _rows_block


@triton.jit
def _load_f32(ptr, m, BF16_BITS: tl.constexpr):
    """fp32 values at ``ptr``: bf16 given as its int16 bits (widened exactly, subnormals kept:
    the interpreter's own bf16 conversion flushes them), else any float dtype."""
    if BF16_BITS:
        b = tl.load(ptr, mask=m, other=0).to(tl.int32)
        return (b << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _act_token_kernel(x_ptr, codes_ptr, scale_ptr, n_rows, k, stride_x, inv_max,
                      INT8: tl.constexpr, CUDA_DIV: tl.constexpr, BF16_BITS: tl.constexpr,
                      SOFT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``BLOCK_R`` tokens: fp8 ``s = amax / 448``, ``inv = 1 / s`` (0 where ``s == 0``),
    ``codes = e4m3(clamp(x * inv))``, scale ``s``; int8 ``a = max(amax, 1e-10)``,
    ``q = clamp(round_half_away(x * (127 / a)), -128, 127)``, scale ``a / 127``.
    ``inv_max``: fp32 ``1 / MAX`` (the CUDA division's multiplier)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = tl.arange(0, BLOCK_K)
    src = x_ptr + rows[:, None].to(tl.int64) * stride_x
    dst = codes_ptr + rows[:, None].to(tl.int64) * k
    a = tl.zeros([BLOCK_R], tl.float32)
    nan = tl.zeros([BLOCK_R], tl.int32)
    for k0 in range(0, k, BLOCK_K):
        m = rmask[:, None] & (k0 + cols < k)[None, :]
        x = _load_f32(src + k0 + cols[None, :], m, BF16_BITS)
        a = tl.maximum(a, tl.max(tl.abs(x), axis=1))
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))
    a = tl.where(nan > 0, float("nan"), a)  # torch's amax propagates NaN
    maxv = 127.0 if INT8 else 448.0
    one = tl.full([BLOCK_R], 1.0, tl.float32)
    if INT8:
        a = tl.where(a < 1e-10, 1e-10, a)  # clamp(min=1e-10); NaN stays NaN
    if CUDA_DIV:
        s = a * inv_max
    else:
        s = tl.div_rn(a, tl.full([BLOCK_R], maxv, tl.float32))
    if INT8:
        mult = tl.div_rn(one, a) * maxv
    else:
        mult = tl.where(s == 0.0, 0.0, tl.div_rn(one, tl.where(s == 0.0, 1.0, s)))
    for k0 in range(0, k, BLOCK_K):
        m = rmask[:, None] & (k0 + cols < k)[None, :]
        v = _load_f32(src + k0 + cols[None, :], m, BF16_BITS) * mult[:, None]
        if INT8:
            r = tl.floor(tl.abs(v) + 0.5)
            q = tl.minimum(tl.maximum(tl.where(v < 0, -r, r), -128.0), 127.0).to(tl.int8)
        else:
            q, _ = _e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0), SOFT)
            nan_code = 0x7F | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)  # NaN keeps its sign
            q = tl.where(v != v, nan_code, q.to(tl.int32)).to(tl.uint8)
        tl.store(dst + k0 + cols[None, :], q, mask=m)
    tl.store(scale_ptr + rows, s, mask=rmask)


@triton.jit
def _act_group_kernel(x_ptr, codes_ptr, scale_ptr, n_rows, inv_max, BF16_BITS: tl.constexpr,
                      SOFT: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    """``BLOCK_R`` groups of ``GROUP`` contiguous elements (fp8_block's 1x128 activation groups,
    SGLang's ``per_token_group_quant_fp8``): ``a = max(amax, 1e-10)``, codes
    ``e4m3(clamp(x * (reciprocal(a) * 448)))``, scale ``a * fl(1 / 448)`` (a multiply on every
    device: the reference multiplies by the constant, it does not divide)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = tl.arange(0, GROUP)
    at = rows[:, None].to(tl.int64) * GROUP + cols[None, :]
    m = rmask[:, None] & (cols < GROUP)[None, :]
    x = _load_f32(x_ptr + at, m, BF16_BITS)
    a = tl.max(tl.abs(x), axis=1)
    nan = tl.max((x != x).to(tl.int32), axis=1)
    a = tl.where(nan > 0, float("nan"), a)  # torch's amax propagates NaN
    a = tl.where(a < 1e-10, 1e-10, a)  # clamp(min=1e-10); NaN stays NaN
    s = a * inv_max
    mult = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), a) * 448.0
    v = x * mult[:, None]
    q, _ = _e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0), SOFT)
    nan_code = 0x7F | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)  # NaN keeps its sign
    q = tl.where(v != v, nan_code, q.to(tl.int32)).to(tl.uint8)
    tl.store(codes_ptr + at, q, mask=m)
    tl.store(scale_ptr + rows, s, mask=rmask)


@triton.jit
def _e4m3_decode(byte, SOFT: tl.constexpr):
    """fp32 value of E4M3 bytes (uint8): OCP FP8 E4M3, bias 7, 0x7F / 0xFF NaN."""
    if SOFT:
        b = byte.to(tl.int32)
        e = (b >> 3) & 0xF
        mant = (b & 7).to(tl.float32)
        mag = tl.where(e == 0, mant * 0.001953125,  # 2^-9: subnormals
                       (8.0 + mant) * _pow2(tl.maximum(e, 1) - 10))
        mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
        return tl.where((b & 0x80) != 0, -mag, mag)
    else:
        return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_rows_kernel(codes_ptr, scale_ptr, out_ptr, n_rows, k, FP8: tl.constexpr,
                         BF16_SOFT: tl.constexpr, SOFT: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """``out = dtype(float(codes) * scale[row])`` of a ``BLOCK_R x BLOCK_K`` tile of a
    contiguous ``[rows, k]`` block."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < n_rows
    m = rmask[:, None] & (cols < k)[None, :]
    at = rows[:, None].to(tl.int64) * k + cols[None, :]
    c = tl.load(codes_ptr + at, mask=m, other=0)
    v = _e4m3_decode(c, SOFT) if FP8 else c.to(tl.float32)
    v = v * tl.load(scale_ptr + rows, mask=rmask, other=1.0)[:, None]
    if BF16_SOFT:  # the interpreter's own bf16 cast is not round-to-nearest-even
        v = tl.where(v != v, v, _bf16_rne(v))
    tl.store(out_ptr + at, v.to(out_ptr.dtype.element_ty), mask=m)


def _inv_max(maxv: float) -> float:
    """fp32 ``1 / maxv`` rounded once (as the host computes ATen's reciprocal)."""
    return float(np.float32(1.0) / np.float32(maxv))


_PROBE = {448.0: 1.0 + 4 * 2.0**-23, 127.0: 1.0 + 60 * 2.0**-23}
"""An fp32 value whose quotient by MAX differs between IEEE division and the multiply by
``fl(1 / MAX)``."""


@functools.cache
def torch_divides_by_reciprocal(device_type: str, maxv: float) -> bool:
    """Whether torch computes ``tensor / maxv`` on ``device_type`` as ``tensor * fl(1 / maxv)``
    (ATen's CUDA kernel does) rather than by division (the CPU's): asked of torch once, on a
    value where the two differ, so the kernel follows the torch it must equal."""
    a = torch.tensor([_PROBE[maxv]], dtype=torch.float32, device=device_type)
    return bool((a / maxv).item() == (a * _inv_max(maxv)).item())


def quantize_act_per_token(spec, x: torch.Tensor, cuda_div: bool | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``spec.quantize_activation(x)`` (fp8 / int8 per token) of ``x`` ``[..., K]`` in its own
    dtype: codes ``[..., K]``, fp32 scale ``[..., 1]``. ``cuda_div`` (default: ``x`` on CUDA)
    computes the scale as ``amax * fl(1 / MAX)`` (CUDA torch's scalar division, see the module
    doc) rather than by IEEE division; default: as torch does on ``x``'s device."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    n, k = x2.shape
    int8 = spec.weight_format == "int8"
    maxv = 127.0 if int8 else FP8_E4M3_MAX
    codes = torch.empty((n, k), dtype=torch.int8 if int8 else torch.float8_e4m3fn,
                        device=x.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    if n:
        br, bk = _rows_block(k)
        bf16 = x2.dtype == torch.bfloat16
        if cuda_div is None:
            cuda_div = torch_divides_by_reciprocal(x.device.type, maxv)
        with _on(x2):
            _act_token_kernel[(triton.cdiv(n, br),)](
                x2.view(torch.int16) if bf16 else x2,
                codes.view(torch.int8 if int8 else torch.uint8), scale, n, k, x2.stride(0),
                _inv_max(maxv), INT8=int8, CUDA_DIV=cuda_div, BF16_BITS=bf16, SOFT=_SOFT,
                BLOCK_R=br, BLOCK_K=bk, num_warps=8)
    return codes.view(*shape), scale.view(*shape[:-1], 1)


def quantize_act_per_token_group(spec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_block's dynamic 1 x ``spec.act_group`` activation quantization of ``x`` ``[..., K]``
    (``K`` a multiple of the group) in its own dtype, one kernel: codes ``[..., K]`` E4M3 and
    fp32 scales ``[..., K / group]`` (SGLang's ``per_token_group_quant_fp8`` layout), bit for
    bit the codes and scales of the format's torch reference (``FP8BlockSpec._act``)."""
    group = spec.act_group
    shape = x.shape
    if shape[-1] % group:
        raise ValueError(f"{spec.name}: activation dim {shape[-1]} is not a multiple of {group}")
    x2 = x.contiguous().view(-1, group)
    n = x2.shape[0]
    codes = torch.empty((n, group), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    if n:
        br = max(1, 8192 // group)
        bf16 = x2.dtype == torch.bfloat16
        with _on(x2):
            _act_group_kernel[(triton.cdiv(n, br),)](
                x2.view(torch.int16) if bf16 else x2, codes.view(torch.uint8), scale, n,
                _inv_max(FP8_E4M3_MAX), BF16_BITS=bf16, SOFT=_SOFT, BLOCK_R=br, GROUP=group,
                num_warps=8)
    return codes.view(shape), scale.view(*shape[:-1], shape[-1] // group)


def dequantize_rows(spec, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                    ) -> torch.Tensor:
    """``(codes.float() * scale).to(dtype)`` of int8 / E4M3 ``codes`` ``[..., K]`` with one fp32
    ``scale`` ``[..., 1]`` per row, in one kernel (``spec`` unused: a fused-kernel signature)."""
    codes = codes.contiguous()
    k = codes.shape[-1]
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    rows = codes.numel() // max(k, 1)
    if codes.numel():
        fp8 = codes.dtype == torch.float8_e4m3fn
        br, bk = 16, min(256, triton.next_power_of_2(k))
        with _on(codes):
            _dequant_rows_kernel[(triton.cdiv(rows, br), triton.cdiv(k, bk))](
                codes.view(torch.uint8) if fp8 else codes, scale.float().contiguous(), out,
                rows, k, FP8=fp8, BF16_SOFT=_SOFT and dtype == torch.bfloat16, SOFT=_SOFT,
                BLOCK_R=br, BLOCK_K=bk, num_warps=4)
    return out
