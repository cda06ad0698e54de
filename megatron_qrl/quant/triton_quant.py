"""Fused Triton quantizers: the pack's reference quantizers in one or two passes per weight.

Each kernel reads the weight once for its scales' amax and once more (from L1/L2: the same
row, group or block) to write codes, scales and, for the 4-bit formats, the packed words the
engine loads, and returns bit for bit what the format's ``_quantize`` (pure torch, the ground
truth) returns: the same operations in fp32 (``s = MAX / amax``, which torch computes as
``reciprocal(amax) * MAX``: ``Tensor.__rdiv__``; ``codes = e4m3(w * s)``; ``scale = 1 / s``; w4a16's ``q = round(w / bf16(amax / 7))``; nvfp4's two-level scales), IEEE
division (``tl.div_rn``), round-half-even (:func:`_rne`), and E4M3's and bf16's
round-to-nearest-even casts. ``tests/quant/test_fused_quant.py`` (Triton's interpreter) and
``tests/gpu/test_fused_quant.py`` (compiled, CUDA) hold them to the reference.

Under ``TRITON_INTERPRET=1`` the float8 cast is done by bit arithmetic (:func:`_e4m3_soft`):
the interpreter's own fp32 -> float8 conversion rounds ties up and drops the mantissa carry.
Each kernel also writes the amax of every program's tile with NaN read as +inf, so the caller
checks finiteness on that small tensor instead of a pass over the weight.
Imported only where Triton is installed (:mod:`.fused`).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .numerics import E2M1_MAX, FP8_E4M3_MAX, ZERO_AMAX_EPS
from .weight import QuantizedWeight

_SOFT = os.environ.get("TRITON_INTERPRET", "0") == "1"
_E4M3_MIN_SUBNORMAL = 2.0**-9


@triton.jit
def _rne(x):
    """Round half to even of fp32 ``|x| < 2^22`` (``torch.round``) by comparing ``x`` with
    the exact midpoint ``floor(x) + 0.5``: no ``x - floor(x)`` that the compiler could contract
    with the product ``x`` came from into one fused multiply-add (unrounded). Zero's sign may
    differ (callers cast to integers)."""
    f = tl.floor(x)
    mid = f + 0.5
    odd = (f.to(tl.int32) & 1) == 1
    return tl.where((x > mid) | ((x == mid) & odd), f + 1.0, f)


@triton.jit
def _nan_abs(x):
    """``|x|`` with NaN as +inf, so an amax over it is non-finite iff the tile is."""
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def _pow2(e):
    """``2.0 ** e`` in fp32 for int32 ``-126 <= e <= 127`` (built from its exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _signed(mag, neg):
    """fp32 ``mag`` (``>= +0``) with its sign bit set where ``neg``, ``-0.0`` for a zero: Triton
    before 3.8 builds a float's unary minus as ``0 - x``, which gives ``+0.0`` for ``x = +0.0``."""
    return (mag.to(tl.int32, bitcast=True) | (neg.to(tl.int32) << 31)).to(tl.float32,
                                                                           bitcast=True)


@triton.jit
def _e4m3_soft(v):
    """(E4M3 code as int32, its fp32 value) of fp32 ``|v| <= 448`` rounded to nearest even
    (OCP FP8 E4M3: bias 7, subnormal step 2^-9): ``rne(|v| * 2^(3-e))`` mantissa steps past
    ``(e + 6) * 8`` for ``|v| >= 2^-6``, ``rne(|v| * 2^9)`` below (a carry moves up a binade)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = tl.abs(v)
    e = ((bits >> 23) & 0xFF) - 127
    normal = mag >= 0.015625
    e = tl.where(normal, e, -6)
    steps = _rne(mag * _pow2(3 - e))
    code = tl.where(normal, (e + 6) * 8 + steps.to(tl.int32), steps.to(tl.int32))
    val = steps * _pow2(e - 3)
    return code | (sign << 7), _signed(val, sign == 1)


@triton.jit
def _e4m3(v, SOFT: tl.constexpr):
    """(E4M3 byte as uint8, its fp32 value) of ``v`` already clamped to +-448."""
    if SOFT:
        code, val = _e4m3_soft(v)
        code = code.to(tl.uint8)
    else:
        f8 = v.to(tl.float8e4nv)
        code = f8.to(tl.uint8, bitcast=True)
        val = f8.to(tl.float32)
    return code, val


@triton.jit
def _bf16_rne(x):
    """fp32 ``x`` (finite) rounded to the nearest-even bf16 value, as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _channel_into_kernel(w_ptr, codes_ptr, scale_ptr, amax_ptr, n_rows, k, sw_e, sw_r,
                         sc_e, sc_r, ss_e, ss_r, MAXV: tl.constexpr, INT8: tl.constexpr,
                         EPS: tl.constexpr, SOFT: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """Per output channel (fp8 / int8 ``_quantize``; ModelOpt ``tensor_quant._tensor_quant``
    / ``_fp8_eager``): ``s = MAX / amax_row`` (as torch: ``reciprocal(amax) * MAX``),
    ``codes = e4m3(w * s)`` or ``clamp(rne(w * s), -127, 127)``, ``scale = 1 / s``; for
    expert ``program_id(1)`` of an ``[E, rows, k]`` stack (one weight: ``E = 1``), with codes
    and scales written into strided regions (their own tensors, or another's: an expert
    stack's half of every expert's ``w13``, a fused ``qkv``'s rows): element ``[e, r, c]`` of
    the weight / codes at ``e * s_e + r * s_r + c``, scale ``[e, r]`` at ``e * ss_e + r *
    ss_r``; the row amaxes go to ``amax[e, r]`` (contiguous)."""
    e = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = tl.arange(0, BLOCK_K)
    r64 = rows[:, None].to(tl.int64)
    src = w_ptr + e * sw_e + r64 * sw_r
    dst = codes_ptr + e * sc_e + r64 * sc_r
    a = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        m = rmask[:, None] & (k0 + cols < k)[None, :]
        x = tl.load(src + k0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        a = tl.maximum(a, tl.max(_nan_abs(x), axis=1))
    zero = a <= EPS
    s = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.where(zero, 1.0, a)) * MAXV
    inv = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), s)
    for k0 in range(0, k, BLOCK_K):
        m = rmask[:, None] & (k0 + cols < k)[None, :]
        x = tl.load(src + k0 + cols[None, :], mask=m, other=0.0).to(tl.float32) * s[:, None]
        if INT8:
            q = tl.minimum(tl.maximum(_rne(x), -127.0), 127.0)
            q = tl.where(zero[:, None], 0.0, q).to(tl.int8)
        else:
            q, _ = _e4m3(tl.minimum(tl.maximum(x, -MAXV), MAXV), SOFT)
        tl.store(dst + k0 + cols[None, :], q, mask=m)
    if INT8:
        inv = tl.where(zero, 1.0, inv)
    tl.store(scale_ptr + e * ss_e + rows.to(tl.int64) * ss_r, inv, mask=rmask)
    tl.store(amax_ptr + e * n_rows + rows, a, mask=rmask)


@triton.jit
def _fp8_block_tile(x, EPS: tl.constexpr, SOFT: tl.constexpr):
    """(E4M3 codes, ``weight_scale_inv``, amax) of one 128x128 block ``x`` (fp32; masked
    edges loaded as 0: zero padding never changes an amax): fp8_block ``_quantize``,
    DeepSeek-V3's layout, ModelOpt ``_fp8_eager`` per block: ``s = 448 / amax_block`` (as
    torch: ``reciprocal(amax) * 448``; an amax ``<= EPS`` counts as 1),
    ``codes = e4m3(w * s)``, ``weight_scale_inv = 1 / s``; the amax with NaN read as +inf."""
    a = tl.max(tl.max(_nan_abs(x), axis=1), axis=0)
    s = tl.div_rn(1.0, tl.where(a <= EPS, 1.0, a)) * 448.0
    q, _ = _e4m3(tl.minimum(tl.maximum(x * s, -448.0), 448.0), SOFT)
    return q, tl.div_rn(1.0, s), a


@triton.jit
def _fp8_block_kernel(w_ptr, codes_ptr, scale_ptr, amax_ptr, n, k, stride_w, kb,
                      EPS: tl.constexpr, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    """One 128x128 block (:func:`_fp8_block_tile`) of an ``[n, k]`` weight into new
    contiguous codes ``[n, k]``, scales and amaxes ``[nb, kb]``; edges masked."""
    bn, bk = tl.program_id(0), tl.program_id(1)
    rows = bn * BLOCK + tl.arange(0, BLOCK)
    cols = bk * BLOCK + tl.arange(0, BLOCK)
    m = (rows < n)[:, None] & (cols < k)[None, :]
    x = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=m,
                other=0.0).to(tl.float32)
    q, inv, a = _fp8_block_tile(x, EPS, SOFT)
    tl.store(codes_ptr + rows[:, None].to(tl.int64) * k + cols[None, :], q, mask=m)
    tl.store(scale_ptr + bn * kb + bk, inv)
    tl.store(amax_ptr + bn * kb + bk, a)


@triton.jit
def _fp8_block_into_kernel(w_ptr, codes_ptr, scale_ptr, amax_ptr, n, k, kb, sw_e, sw_r,
                           sc_e, sc_r, ss_e, ss_r, ss_c, EPS: tl.constexpr,
                           SOFT: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``(program_id(0), program_id(1))`` (:func:`_fp8_block_tile`) of expert
    ``program_id(2)`` of an ``[E, n, k]`` stack (one weight: ``E = 1``), codes and scales
    written into strided regions (an expert stack's half of every expert's ``w13`` and of
    its ``w13_weight_scale_inv``, a fused ``qkv``'s rows and block rows): element
    ``[e, r, c]`` of the weight / codes at ``e * s_e + r * s_r + c``, scale ``[e, i, j]`` at
    ``e * ss_e + i * ss_r + j * ss_c``; the block amaxes go to ``amax[e, i, j]``
    (contiguous); edges masked."""
    bn, bk = tl.program_id(0), tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rows = bn * BLOCK + tl.arange(0, BLOCK)
    cols = bk * BLOCK + tl.arange(0, BLOCK)
    m = (rows < n)[:, None] & (cols < k)[None, :]
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(w_ptr + e * sw_e + r64 * sw_r + cols[None, :], mask=m,
                other=0.0).to(tl.float32)
    q, inv, a = _fp8_block_tile(x, EPS, SOFT)
    tl.store(codes_ptr + e * sc_e + r64 * sc_r + cols[None, :], q, mask=m)
    tl.store(scale_ptr + e * ss_e + bn * ss_r + bk * ss_c, inv)
    tl.store(amax_ptr + (e * tl.num_programs(0) + bn) * kb + bk, a)


@triton.jit
def _w4a16_kernel(w_ptr, codes_ptr, packed_ptr, scale_ptr, amax_ptr, n_rows, k, stride_w,
                  EPS: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    """One group of 128 in ``BLOCK_R`` rows (w4a16 ``_quantize``: ModelOpt's INT4 blockwise
    rule with the scale in bf16; ``pack_int4_to_int32``: compressed-tensors ``pack_to_int32``):
    ``s = bf16(amax_g / 7)``, ``q = clamp(rne(w / s), -8, 7)``, eight ``q + 8`` nibbles per
    int32, lowest first."""
    g = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = g * GROUP + tl.arange(0, GROUP)
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(w_ptr + r64 * stride_w + cols[None, :], mask=rmask[:, None],
                other=0.0).to(tl.float32)
    a = tl.max(_nan_abs(x), axis=1)
    s = _bf16_rne(tl.where(a <= EPS, 1.0, tl.div_rn(a, tl.full([BLOCK_R], 7.0, tl.float32))))
    q = tl.minimum(tl.maximum(_rne(tl.div_rn(x, s[:, None])), -8.0), 7.0).to(tl.int32)
    tl.store(codes_ptr + r64 * k + cols[None, :], q.to(tl.int8), mask=rmask[:, None])
    nib = tl.reshape((q + 8) & 0xF, [BLOCK_R, GROUP // 8, 8])
    words = tl.sum(nib << (tl.arange(0, 8) * 4)[None, None, :], axis=2)
    wcols = g * (GROUP // 8) + tl.arange(0, GROUP // 8)
    tl.store(packed_ptr + r64 * (k // 8) + wcols[None, :], words, mask=rmask[:, None])
    n_groups = k // GROUP
    tl.store(scale_ptr + rows.to(tl.int64) * n_groups + g, s.to(tl.bfloat16), mask=rmask)
    tl.store(amax_ptr + rows.to(tl.int64) * n_groups + g, a, mask=rmask)


@triton.jit
def _nvfp4_kernel(w_ptr, s2_ptr, s2_stride, codes_ptr, packed_ptr, scale_ptr, amax_ptr,
                  n_rows, k, stride_w, SOFT: tl.constexpr, BLOCK_R: tl.constexpr,
                  NB: tl.constexpr, BLOCK: tl.constexpr):
    """``NB`` blocks of 16 in ``BLOCK_R`` rows (nvfp4 ``quantize_rows`` and ``pack_nibbles``;
    QeRL seed 002 / docs/ALGORITHMS.md sec. 3, ModelOpt ``NVFP4QTensor.quantize``):
    ``s_blk = e4m3(clamp(amax_blk / (6 s2), 2^-9, 448))`` (0 -> 1), ``W_q = e2m1(W / (s_blk
    s2))`` to nearest, ties to the even mantissa, saturating at 6 (OCP MX v1.0 sec. 5.3.3)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = tl.program_id(1) * (NB * BLOCK) + tl.arange(0, NB * BLOCK)
    r64 = rows[:, None].to(tl.int64)
    cmask = rmask[:, None] & (cols < k)[None, :]
    x = tl.load(w_ptr + r64 * stride_w + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
    xb = tl.reshape(x, [BLOCK_R, NB, BLOCK])
    a = tl.max(_nan_abs(xb), axis=2)
    s2 = tl.load(s2_ptr + rows.to(tl.int64) * s2_stride, mask=rmask, other=1.0)
    sb = tl.div_rn(a, (6.0 * s2)[:, None])
    sb = tl.minimum(tl.maximum(tl.where(sb == 0.0, 1.0, sb), 2.0**-9), 448.0)
    sb_code, sb_val = _e4m3(sb, SOFT)
    y = tl.div_rn(xb, (sb_val * s2[:, None])[:, :, None])
    mag = tl.abs(y)
    ordinal = ((mag > 0.25).to(tl.int32) + (mag > 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
               + (mag > 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag > 3.5).to(tl.int32)
               + (mag > 5.0).to(tl.int32)
               + ((mag == 0.75) | (mag == 1.75) | (mag == 3.5)).to(tl.int32))
    code = tl.reshape(((y < 0).to(tl.int32) << 3) | ordinal, [BLOCK_R, NB * BLOCK])
    tl.store(codes_ptr + r64 * k + cols[None, :], code.to(tl.uint8), mask=cmask)
    pairs = tl.reshape(code, [BLOCK_R, NB * BLOCK // 2, 2])
    byte = tl.sum(pairs << (tl.arange(0, 2) * 4)[None, None, :], axis=2)
    pcols = tl.program_id(1) * (NB * BLOCK // 2) + tl.arange(0, NB * BLOCK // 2)
    tl.store(packed_ptr + r64 * (k // 2) + pcols[None, :], byte.to(tl.uint8),
             mask=rmask[:, None] & (pcols < k // 2)[None, :])
    bcols = tl.program_id(1) * NB + tl.arange(0, NB)
    bmask = rmask[:, None] & (bcols < k // BLOCK)[None, :]
    at = r64 * (k // BLOCK) + bcols[None, :]
    tl.store(scale_ptr + at, sb_code, mask=bmask)
    tl.store(amax_ptr + at, a, mask=bmask)


def _on(w: torch.Tensor):
    """Launch on ``w``'s GPU (Triton launches on the current device)."""
    return torch.cuda.device(w.device) if w.is_cuda else contextlib.nullcontext()


def _f32(shape, device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=device)


def _rows_block(k: int) -> tuple[int, int]:
    """(rows, columns) of a per-channel tile: up to 4096 columns, ~8k elements."""
    bk = min(triton.next_power_of_2(max(k, 1)), 4096)
    return max(1, min(64, 8192 // bk)), bk


def quantize_channel(spec, w: torch.Tensor) -> tuple[QuantizedWeight, torch.Tensor]:
    """fp8 / int8 per output channel: (the :class:`QuantizedWeight`, the row amaxes)."""
    n, k = w.shape
    w = w if w.stride(1) == 1 else w.contiguous()
    int8 = spec.weight_format == "int8"
    codes = torch.empty((n, k), dtype=torch.int8 if int8 else torch.float8_e4m3fn,
                        device=w.device)
    scale, amax = _f32((n, 1), w.device), _f32((n,), w.device)
    br, bk = _rows_block(k)
    with _on(w):
        _channel_into_kernel[(triton.cdiv(n, br), 1)](
            w, codes.view(torch.int8 if int8 else torch.uint8), scale, amax, n, k, 0,
            w.stride(0), 0, k, 0, 1, MAXV=127.0 if int8 else FP8_E4M3_MAX, INT8=int8,
            EPS=ZERO_AMAX_EPS, SOFT=_SOFT, BLOCK_R=br, BLOCK_K=bk, num_warps=8)
    return QuantizedWeight(spec.name, codes, scale, None, (n, k), w.dtype), amax


def quantize_channel_into(spec, w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
                          ) -> torch.Tensor:
    """fp8 / int8 per output channel of the expert stack ``w`` ``[E, n, k]`` written into
    ``codes`` ``[E, n, k]`` and ``scale`` ``[E, n, 1]``, views of another tensor with any
    strides but a contiguous last dimension of ``codes`` (:meth:`~.spec_core.SpecCore.
    quantize_into`): :func:`quantize_channel`'s codes and scales, in one launch; returns the
    row amaxes ``[E, n]``."""
    e, n, k = w.shape
    if codes.stride(-1) != 1 and k > 1:
        raise ValueError(f"quantize_channel_into writes rows of codes; got strides {codes.stride()}")
    w = w if w.stride(-1) == 1 or k == 1 else w.contiguous()
    int8 = spec.weight_format == "int8"
    amax = _f32((e, n), w.device)
    br, bk = _rows_block(k)
    with _on(w):
        _channel_into_kernel[(triton.cdiv(n, br), e)](
            w, codes.view(torch.int8 if int8 else torch.uint8), scale, amax, n, k,
            w.stride(0), w.stride(1), codes.stride(0), codes.stride(1), scale.stride(0),
            scale.stride(1), MAXV=127.0 if int8 else FP8_E4M3_MAX, INT8=int8,
            EPS=ZERO_AMAX_EPS, SOFT=_SOFT, BLOCK_R=br, BLOCK_K=bk, num_warps=8)
    return amax


def quantize_fp8_block(spec, w: torch.Tensor) -> tuple[QuantizedWeight, torch.Tensor]:
    """fp8_block (128x128 blocks, ``weight_scale_inv``): (weight, block amaxes)."""
    n, k = w.shape
    bs = spec.block[0]
    w = w if w.stride(1) == 1 else w.contiguous()
    nb, kb = triton.cdiv(n, bs), triton.cdiv(k, bs)
    codes = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    scale, amax = _f32((nb, kb), w.device), _f32((nb, kb), w.device)
    with _on(w):
        _fp8_block_kernel[(nb, kb)](w, codes.view(torch.uint8), scale, amax, n, k, w.stride(0),
                                    kb, EPS=ZERO_AMAX_EPS, SOFT=_SOFT, BLOCK=bs, num_warps=16)
    return QuantizedWeight(spec.name, codes, scale, None, (n, k), w.dtype), amax


def quantize_fp8_block_into(spec, w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
                            ) -> torch.Tensor:
    """fp8_block (128x128 blocks) of the expert stack ``w`` ``[E, n, k]`` written into
    ``codes`` ``[E, n, k]`` and ``scale`` (``weight_scale_inv``) ``[E, ceil(n/128),
    ceil(k/128)]``, views of another tensor with any strides but a contiguous last dimension
    of ``codes`` (:meth:`~.spec_core.SpecCore.quantize_into`): :func:`quantize_fp8_block`'s
    codes and scales per expert, in one launch; returns the block amaxes ``[E, nb, kb]``."""
    e, n, k = w.shape
    if codes.stride(-1) != 1 and k > 1:
        raise ValueError(f"quantize_fp8_block_into writes rows of codes; got strides "
                         f"{codes.stride()}")
    w = w if w.stride(-1) == 1 or k == 1 else w.contiguous()
    bs = spec.block[0]
    nb, kb = triton.cdiv(n, bs), triton.cdiv(k, bs)
    amax = _f32((e, nb, kb), w.device)
    with _on(w):
        _fp8_block_into_kernel[(nb, kb, e)](
            w, codes.view(torch.uint8), scale, amax, n, k, kb, w.stride(0), w.stride(1),
            codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
            scale.stride(2), EPS=ZERO_AMAX_EPS, SOFT=_SOFT, BLOCK=bs, num_warps=16)
    return amax


def quantize_w4a16(spec, w: torch.Tensor) -> tuple[QuantizedWeight, torch.Tensor]:
    """w4a16 (int4 groups of 128, bf16 scales): the weight, with its ``weight_packed`` int32
    words in :attr:`QuantizedWeight.packed`, and the group amaxes."""
    n, k = w.shape
    group = spec.block[1]
    w = w if w.stride(1) == 1 else w.contiguous()
    codes = torch.empty((n, k), dtype=torch.int8, device=w.device)
    packed = torch.empty((n, k // 8), dtype=torch.int32, device=w.device)
    scale = torch.empty((n, k // group), dtype=torch.bfloat16, device=w.device)
    amax = _f32((n, k // group), w.device)
    br = 16
    with _on(w):
        _w4a16_kernel[(triton.cdiv(n, br), k // group)](
            w, codes, packed, scale, amax, n, k, w.stride(0), EPS=ZERO_AMAX_EPS, BLOCK_R=br,
            GROUP=group, num_warps=4)
    return QuantizedWeight(spec.name, codes, scale, None, (n, k), w.dtype, packed), amax


def quantize_nvfp4(spec, w: torch.Tensor, s2: torch.Tensor
                   ) -> tuple[QuantizedWeight, torch.Tensor]:
    """nvfp4 given its tensor scale ``s2`` (scalar or ``[out, 1]``): the weight, with its
    nibble-packed ``weight`` in :attr:`QuantizedWeight.packed`, and the block amaxes."""
    n, k = w.shape
    block = spec.block[1]
    w = w if w.stride(1) == 1 else w.contiguous()
    s2f = s2.float().contiguous()
    codes = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((n, k // block), dtype=torch.float8_e4m3fn, device=w.device)
    amax = _f32((n, k // block), w.device)
    br, nb = 16, 8
    with _on(w):
        _nvfp4_kernel[(triton.cdiv(n, br), triton.cdiv(k, nb * block))](
            w, s2f, 1 if s2f.dim() == 2 else 0, codes, packed, scale.view(torch.uint8), amax,
            n, k, w.stride(0), SOFT=_SOFT, BLOCK_R=br, NB=nb, BLOCK=block, num_warps=4)
    return QuantizedWeight(spec.name, codes, scale, s2, (n, k), w.dtype, packed), amax


assert E2M1_MAX == 6.0 and FP8_E4M3_MAX == 448.0  # the kernels' literals
