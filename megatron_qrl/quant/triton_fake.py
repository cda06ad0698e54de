"""Fused Triton fake quantization: ``dequantize(quantize(w)).to(w.dtype)`` in one kernel.

The aligned forward refreshes its fake-quantized weights once per optimizer step
(:meth:`~megatron_qrl.quant.spec_core.SpecCore.quantize_dequantize`); the formats' torch
``_fake_quant`` spends a handful of fp32 elementwise passes on it. Each kernel here reads the
weight (in its own dtype) once for the scales' amax and writes the dequantized weight in that
dtype, bit for bit what the torch path returns: the quantizers of :mod:`.triton_quant` (the
same scale arithmetic: ``s = reciprocal(amax) * MAX``, ``tl.div_rn``, :func:`_rne`, the E4M3
cast), then the reference's dequantization in fp32 (``codes * (1 / s)``, ``q * s``,
``e2m1 * (s_blk * s2)``) and one round-to-nearest-even cast to the weight's dtype. Signed
zeros follow the reference: the integer formats' ``0 + q * s`` gives ``+0.0`` (here: the code
through int32), the float formats keep the code's sign, set as a bit (:func:`_signed`: a value
``-0.0`` where a negative rounds to zero, on every Triton version).

bf16 is read and written as its int16 bits (:func:`_load_f32`; :func:`_store_out` rounds with
:func:`_bf16_rne`): the interpreter's own bf16 conversions flush subnormals and truncate, and
the one path then runs compiled and interpreted alike. Each kernel also writes the amax of
every scale's tile with NaN read as +inf (the finiteness check, as :mod:`.triton_quant`).
``tests/quant/test_fused_fake_quant.py`` (Triton's interpreter) and
``tests/gpu/test_fused_quant.py`` (compiled, CUDA) hold them to the torch path.
Imported only where Triton is installed (:mod:`.fused`, ``fused_fake_kernel``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import FP8_E4M3_MAX, ZERO_AMAX_EPS
from .triton_act import _load_f32
from .triton_quant import _SOFT, _bf16_rne, _e4m3, _f32, _nan_abs, _on, _rne, _rows_block, _signed


@triton.jit
def _store_out(ptr, v, m, BF16_BITS: tl.constexpr):
    """Store fp32 ``v`` rounded to the output's dtype (to nearest, ties to even); with
    ``BF16_BITS`` ``ptr`` is a bf16 tensor's int16 view."""
    if BF16_BITS:
        b = _bf16_rne(v).to(tl.int32, bitcast=True) >> 16
        tl.store(ptr, b.to(tl.int16), mask=m)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _channel_fake_kernel(w_ptr, out_ptr, amax_ptr, n_rows, k, stride_w, MAXV: tl.constexpr,
                         INT8: tl.constexpr, EPS: tl.constexpr, SOFT: tl.constexpr,
                         BF16_BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per output channel (fp8 / int8 ``_fake_quant``): ``s = reciprocal(amax_row) * MAX``;
    fp8 ``e4m3(w * s) * (1 / s)``, int8 ``round(w * s) * (1 / s)`` (scale 1 and codes 0 on a
    zero row)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = tl.arange(0, BLOCK_K)
    src = w_ptr + rows[:, None].to(tl.int64) * stride_w
    dst = out_ptr + rows[:, None].to(tl.int64) * k
    a = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        m = rmask[:, None] & (k0 + cols < k)[None, :]
        a = tl.maximum(a, tl.max(_nan_abs(_load_f32(src + k0 + cols[None, :], m, BF16_BITS)),
                                 axis=1))
    zero = a <= EPS
    s = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.where(zero, 1.0, a)) * MAXV
    inv = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), s)
    if INT8:
        inv = tl.where(zero, 1.0, inv)
    for k0 in range(0, k, BLOCK_K):
        m = rmask[:, None] & (k0 + cols < k)[None, :]
        x = _load_f32(src + k0 + cols[None, :], m, BF16_BITS) * s[:, None]
        if INT8:  # the code through int32: round(-0.3) is +0, as the reference's int8 code
            q = tl.minimum(tl.maximum(_rne(x), -127.0), 127.0)
            v = tl.where(zero[:, None], 0.0, q).to(tl.int32).to(tl.float32)
        else:
            _, v = _e4m3(tl.minimum(tl.maximum(x, -MAXV), MAXV), SOFT)
        _store_out(dst + k0 + cols[None, :], v * inv[:, None], m, BF16_BITS)
    tl.store(amax_ptr + rows, a, mask=rmask)


@triton.jit
def _fp8_block_fake_kernel(w_ptr, out_ptr, amax_ptr, n, k, stride_w, kb, EPS: tl.constexpr,
                           SOFT: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """One 128x128 block (fp8_block ``_fake_quant``): ``s = reciprocal(amax_block) * 448``,
    ``e4m3(w * s) * (1 / s)``; edges masked (zero padding never changes an amax)."""
    bn, bk = tl.program_id(0), tl.program_id(1)
    rows = bn * BLOCK + tl.arange(0, BLOCK)
    cols = bk * BLOCK + tl.arange(0, BLOCK)
    m = (rows < n)[:, None] & (cols < k)[None, :]
    x = _load_f32(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], m, BF16_BITS)
    a = tl.max(tl.max(_nan_abs(x), axis=1), axis=0)
    s = tl.div_rn(1.0, tl.where(a <= EPS, 1.0, a)) * 448.0
    _, v = _e4m3(tl.minimum(tl.maximum(x * s, -448.0), 448.0), SOFT)
    _store_out(out_ptr + rows[:, None].to(tl.int64) * k + cols[None, :], v * tl.div_rn(1.0, s),
               m, BF16_BITS)
    tl.store(amax_ptr + bn * kb + bk, a)


@triton.jit
def _w4a16_fake_kernel(w_ptr, out_ptr, amax_ptr, n_rows, k, stride_w, EPS: tl.constexpr,
                       BF16_BITS: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    """One group of 128 in ``BLOCK_R`` rows (w4a16 ``_fake_quant``): ``s = bf16(amax_g / 7)``
    (1 on a zero group), ``q = rne(w / s)`` (through int32: ``+0``), ``q * s``."""
    g = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = g * GROUP + tl.arange(0, GROUP)
    r64 = rows[:, None].to(tl.int64)
    x = _load_f32(w_ptr + r64 * stride_w + cols[None, :], rmask[:, None], BF16_BITS)
    a = tl.max(_nan_abs(x), axis=1)
    s = _bf16_rne(tl.where(a <= EPS, 1.0, tl.div_rn(a, tl.full([BLOCK_R], 7.0, tl.float32))))
    q = tl.minimum(tl.maximum(_rne(tl.div_rn(x, s[:, None])), -8.0), 7.0).to(tl.int32)
    _store_out(out_ptr + r64 * k + cols[None, :], q.to(tl.float32) * s[:, None], rmask[:, None],
               BF16_BITS)
    tl.store(amax_ptr + rows.to(tl.int64) * (k // GROUP) + g, a, mask=rmask)


@triton.jit
def _nvfp4_fake_kernel(w_ptr, s2_ptr, s2_stride, out_ptr, amax_ptr, n_rows, k, stride_w,
                       SOFT: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_R: tl.constexpr,
                       NB: tl.constexpr, BLOCK: tl.constexpr):
    """``NB`` blocks of 16 in ``BLOCK_R`` rows (nvfp4 ``fake_quant_rows``; QeRL seed 002 /
    docs/ALGORITHMS.md sec. 3): ``d = e4m3(clamp(amax_blk / (6 s2), 2^-9, 448)) * s2``
    (0 -> 1), ``W_hat = e2m1(W / d) * d``, the E2M1 value with the sign bit of ``W / d < 0``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = tl.program_id(1) * (NB * BLOCK) + tl.arange(0, NB * BLOCK)
    r64 = rows[:, None].to(tl.int64)
    cmask = rmask[:, None] & (cols < k)[None, :]
    x = _load_f32(w_ptr + r64 * stride_w + cols[None, :], cmask, BF16_BITS)
    xb = tl.reshape(x, [BLOCK_R, NB, BLOCK])
    a = tl.max(_nan_abs(xb), axis=2)
    s2 = tl.load(s2_ptr + rows.to(tl.int64) * s2_stride, mask=rmask, other=1.0)
    sb = tl.div_rn(a, (6.0 * s2)[:, None])
    sb = tl.minimum(tl.maximum(tl.where(sb == 0.0, 1.0, sb), 2.0**-9), 448.0)
    _, sb_val = _e4m3(sb, SOFT)
    d = (sb_val * s2[:, None])[:, :, None]
    y = tl.div_rn(xb, d)
    mag = tl.abs(y)
    o = ((mag > 0.25).to(tl.float32) + (mag > 0.75).to(tl.float32)
         + (mag > 1.25).to(tl.float32) + (mag > 1.75).to(tl.float32)
         + (mag > 2.5).to(tl.float32) + (mag > 3.5).to(tl.float32) + (mag > 5.0).to(tl.float32)
         + ((mag == 0.75) | (mag == 1.75) | (mag == 3.5)).to(tl.float32))
    val = tl.where(o < 4.0, o * 0.5, tl.where(o == 7.0, 6.0, o - 2.0))  # E2M1 by ordinal
    val = _signed(val, y < 0) * d
    _store_out(out_ptr + r64 * k + cols[None, :], tl.reshape(val, [BLOCK_R, NB * BLOCK]), cmask,
               BF16_BITS)
    bcols = tl.program_id(1) * NB + tl.arange(0, NB)
    tl.store(amax_ptr + r64 * (k // BLOCK) + bcols[None, :], a,
             mask=rmask[:, None] & (bcols < k // BLOCK)[None, :])


def _io(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(``w`` with unit column stride, the output ``[n, k]`` in ``w``'s dtype, and the two as
    the kernels take them: bf16 as int16 bits, :func:`_store_out`)."""
    w = w if w.stride(1) == 1 else w.contiguous()
    out = torch.empty(w.shape, dtype=w.dtype, device=w.device)
    bf16 = w.dtype == torch.bfloat16
    if bf16:
        return out, w.view(torch.int16), out.view(torch.int16), True
    return out, w, out, False


def fake_quant_channel(spec, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 / int8 per output channel: (the fake-quantized weight in ``w``'s dtype, the row
    amaxes)."""
    n, k = w.shape
    out, src, dst, bf16 = _io(w)
    int8 = spec.weight_format == "int8"
    amax = _f32((n,), w.device)
    br, bk = _rows_block(k)
    with _on(w):
        _channel_fake_kernel[(triton.cdiv(n, br),)](
            src, dst, amax, n, k, src.stride(0), MAXV=127.0 if int8 else FP8_E4M3_MAX, INT8=int8,
            EPS=ZERO_AMAX_EPS, SOFT=_SOFT, BF16_BITS=bf16, BLOCK_R=br, BLOCK_K=bk, num_warps=8)
    return out, amax


def fake_quant_fp8_block(spec, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_block (128x128 blocks): (the fake-quantized weight, the block amaxes)."""
    n, k = w.shape
    bs = spec.block[0]
    out, src, dst, bf16 = _io(w)
    nb, kb = triton.cdiv(n, bs), triton.cdiv(k, bs)
    amax = _f32((nb, kb), w.device)
    with _on(w):
        _fp8_block_fake_kernel[(nb, kb)](src, dst, amax, n, k, src.stride(0), kb,
                                         EPS=ZERO_AMAX_EPS, SOFT=_SOFT, BF16_BITS=bf16,
                                         BLOCK=bs, num_warps=16)
    return out, amax


def fake_quant_w4a16(spec, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w4a16 (int4 groups of 128, bf16 scales): (the fake-quantized weight, the group
    amaxes)."""
    n, k = w.shape
    group = spec.block[1]
    out, src, dst, bf16 = _io(w)
    amax = _f32((n, k // group), w.device)
    br = 16
    with _on(w):
        _w4a16_fake_kernel[(triton.cdiv(n, br), k // group)](
            src, dst, amax, n, k, src.stride(0), EPS=ZERO_AMAX_EPS, BF16_BITS=bf16, BLOCK_R=br,
            GROUP=group, num_warps=4)
    return out, amax


def fake_quant_nvfp4(spec, w: torch.Tensor, s2: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """nvfp4 given its tensor scale ``s2`` (scalar or ``[out, 1]``): (the fake-quantized
    weight, the block amaxes)."""
    n, k = w.shape
    block = spec.block[1]
    out, src, dst, bf16 = _io(w)
    s2f = s2.float().contiguous()
    amax = _f32((n, k // block), w.device)
    br, nb = 16, 8
    with _on(w):
        _nvfp4_fake_kernel[(triton.cdiv(n, br), triton.cdiv(k, nb * block))](
            src, s2f, 1 if s2f.dim() == 2 else 0, dst, amax, n, k, src.stride(0), SOFT=_SOFT,
            BF16_BITS=bf16, BLOCK_R=br, NB=nb, BLOCK=block, num_warps=4)
    return out, amax
