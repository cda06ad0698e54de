"""Fused Triton kernels of the FP8 backward's gradient operands (:mod:`megatron_qrl.te_quant.fp8_backward`).

- :func:`quantize_grad_rows`: the input gradient's operand ``Q_row(g * sw^T)``: the weight's
  per-channel scale folded into the gradient's columns, then one E4M3 scale per row (token).
  Stacked experts: each row folds its own expert's scales (``row_group``).
- :func:`quantize_grad_cols_t`: the weight gradient's operand ``Q_col(g * sx)``, written
  transposed (``[N, M]``, the row-major ``A`` of the wgrad GEMM): the activation's per-token
  scale folded into the gradient's rows, then one E4M3 scale per output channel over the tokens.

The torch reference (``fp8_backward.quantize_grad_rows`` of the folded fp32 gradient) makes an
fp32 copy of ``g``, folds, transposes (wgrad), takes the amax, divides, clamps and casts: eight
to ten passes over 4-byte elements. Here the BF16 gradient is read twice (the amax, then the
codes) and one byte per element is written. Bit for bit the reference on the device the tensors
are on: the fold is the same fp32 product, ``amax / 448`` is computed as that device's torch
computes a tensor divided by a Python number (``amax * fl(1 / 448)`` on CUDA, IEEE division on
the CPU: :func:`.triton_act.torch_divides_by_reciprocal`), a scale that is not ``> 0`` (a zero or
NaN row) becomes 1, the codes are IEEE quotients ``v / s`` (``tl.div_rn``: torch divides tensor
by tensor), clamped to +-448 and cast to E4M3 round-to-nearest-even; a NaN keeps its sign in its
code (0x7F / 0xFF). E4M3 only: the E5M2 gradient format keeps the torch code.
``tests/quant/test_fused_grad.py`` (interpreter) and ``tests/gpu/test_fused_quant.py``
(compiled) hold them to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import FP8_E4M3_MAX
from .triton_act import _inv_max, _load_f32, torch_divides_by_reciprocal
from .triton_quant import _SOFT, _e4m3, _on, _rows_block


@triton.jit
def _scale_of(a, nan, inv_max, CUDA_DIV: tl.constexpr):
    """The row's (column's) fp32 scale from its amax ``a`` and NaN flag: ``a / 448`` as torch
    on the device (module doc), 1 where that is not ``> 0``."""
    a = tl.where(nan > 0, float("nan"), a)
    if CUDA_DIV:
        s = a * inv_max
    else:
        s = tl.div_rn(a, tl.zeros_like(a) + 448.0)
    return tl.where(s > 0.0, s, 1.0)


@triton.jit
def _codes(v, SOFT: tl.constexpr):
    """E4M3 bytes of ``v`` (already divided by its scale): clamped to +-448, round to nearest
    even; NaN as 0x7F with its sign."""
    q, _ = _e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0), SOFT)
    nan_code = 0x7F | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)
    return tl.where(v != v, nan_code, q.to(tl.int32)).to(tl.uint8)


@triton.jit
def _grad_rows_kernel(g_ptr, w_ptr, grp_ptr, codes_ptr, scale_ptr, n_rows, n, stride_g, inv_max,
                      GROUPED: tl.constexpr, CUDA_DIV: tl.constexpr, BF16_BITS: tl.constexpr,
                      SOFT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``BLOCK_R`` rows of ``g * w`` (``w[n]``, or ``w[grp[row], n]`` where ``GROUPED``): the
    row's amax, scale, then its codes (the row read again, from L2)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    cols = tl.arange(0, BLOCK_K)
    src = g_ptr + rows[:, None].to(tl.int64) * stride_g
    dst = codes_ptr + rows[:, None].to(tl.int64) * n
    if GROUPED:
        wrow = w_ptr + tl.load(grp_ptr + rows, mask=rmask, other=0)[:, None].to(tl.int64) * n
    else:
        wrow = w_ptr + tl.zeros([BLOCK_R, 1], tl.int64)
    a = tl.zeros([BLOCK_R], tl.float32)
    nan = tl.zeros([BLOCK_R], tl.int32)
    for k0 in range(0, n, BLOCK_K):
        m = rmask[:, None] & (k0 + cols < n)[None, :]
        x = _load_f32(src + k0 + cols[None, :], m, BF16_BITS) \
            * tl.load(wrow + k0 + cols[None, :], mask=m, other=0.0)
        a = tl.maximum(a, tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=1))
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))
    s = _scale_of(a, nan, inv_max, CUDA_DIV)
    for k0 in range(0, n, BLOCK_K):
        m = rmask[:, None] & (k0 + cols < n)[None, :]
        x = _load_f32(src + k0 + cols[None, :], m, BF16_BITS) \
            * tl.load(wrow + k0 + cols[None, :], mask=m, other=0.0)
        tl.store(dst + k0 + cols[None, :], _codes(tl.div_rn(x, s[:, None]), SOFT), mask=m)
    tl.store(scale_ptr + rows, s, mask=rmask)


@triton.jit
def _grad_cols_amax_kernel(g_ptr, sx_ptr, amax_ptr, nan_ptr, m_rows, n, stride_g,
                           BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    """A ``BLOCK_M x BLOCK_N`` tile of ``g * sx``: its columns' amax (as fp32 bits: a
    non-negative float orders as its int32 bits) and NaN flags, merged by atomic max."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm, cm = r < m_rows, c < n
    m = rm[:, None] & cm[None, :]
    x = _load_f32(g_ptr + r[:, None].to(tl.int64) * stride_g + c[None, :], m, BF16_BITS) \
        * tl.load(sx_ptr + r, mask=rm, other=0.0)[:, None]
    a = tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=0)
    tl.atomic_max(amax_ptr + c, a.to(tl.int32, bitcast=True), mask=cm)
    tl.atomic_max(nan_ptr + c, tl.max((x != x).to(tl.int32), axis=0), mask=cm)


@triton.jit
def _grad_cols_t_kernel(g_ptr, sx_ptr, amax_ptr, nan_ptr, codes_ptr, scale_ptr, m_rows, n,
                        stride_g, inv_max, CUDA_DIV: tl.constexpr, BF16_BITS: tl.constexpr,
                        SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's codes ``(g * sx) / s[col]``, stored transposed (``codes[col, row]``); the
    first row of tiles stores the scales."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm, cm = r < m_rows, c < n
    m = rm[:, None] & cm[None, :]
    a = tl.load(amax_ptr + c, mask=cm, other=0).to(tl.float32, bitcast=True)
    s = _scale_of(a, tl.load(nan_ptr + c, mask=cm, other=0), inv_max, CUDA_DIV)
    x = _load_f32(g_ptr + r[:, None].to(tl.int64) * stride_g + c[None, :], m, BF16_BITS) \
        * tl.load(sx_ptr + r, mask=rm, other=0.0)[:, None]
    q = _codes(tl.div_rn(x, s[None, :]), SOFT)
    tl.store(codes_ptr + c[:, None].to(tl.int64) * m_rows + r[None, :], tl.trans(q),
             mask=tl.trans(m))
    if tl.program_id(0) == 0:
        tl.store(scale_ptr + c, s, mask=cm)


def _rows_2d(g: torch.Tensor) -> torch.Tensor:
    return g if g.stride(-1) == 1 else g.contiguous()


def _cuda_div(g: torch.Tensor, cuda_div: bool | None) -> bool:
    return torch_divides_by_reciprocal(g.device.type, FP8_E4M3_MAX) if cuda_div is None \
        else cuda_div


def quantize_grad_rows(g: torch.Tensor, col_scale: torch.Tensor,
                       row_group: torch.Tensor | None = None, cuda_div: bool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes ``[M, N]`` and fp32 scales ``[M, 1]`` of ``Q_row(g * col_scale^T)`` for a
    2-D gradient ``g`` (BF16 or fp32) and fp32 ``col_scale`` ``[N]``; with ``row_group``
    (``[M]`` expert index per row) ``col_scale`` is ``[E, N]`` and each row folds its own
    expert's. ``cuda_div`` as in :func:`.triton_act.quantize_act_per_token`."""
    g = _rows_2d(g)
    m, n = g.shape
    codes = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=g.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=g.device)
    if m and n:
        br, bk = _rows_block(n)
        bf16 = g.dtype == torch.bfloat16
        w = col_scale.to(torch.float32).contiguous()
        grp = row_group.to(torch.int32).contiguous() if row_group is not None else w
        with _on(g):
            _grad_rows_kernel[(triton.cdiv(m, br),)](
                g.view(torch.int16) if bf16 else g, w, grp, codes.view(torch.uint8), scale, m,
                n, g.stride(0), _inv_max(FP8_E4M3_MAX), GROUPED=row_group is not None,
                CUDA_DIV=_cuda_div(g, cuda_div), BF16_BITS=bf16, SOFT=_SOFT, BLOCK_R=br,
                BLOCK_K=bk, num_warps=8)
    elif m:
        scale.fill_(1.0)
    return codes, scale


COLS_TILE = (64, 64)
"""(tokens, channels) of one program of :func:`quantize_grad_cols_t`."""


def quantize_grad_cols_t(g: torch.Tensor, row_scale: torch.Tensor, cuda_div: bool | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes ``[N, M]`` (transposed) and fp32 scales ``[N, 1]`` of ``Q_col(g * row_scale)``
    for a 2-D gradient ``g`` ``[M, N]`` and fp32 ``row_scale`` ``[M]`` (or ``[M, 1]``): the
    reference's ``Q_row`` of ``(g * sx)^T``."""
    g = _rows_2d(g)
    m, n = g.shape
    codes = torch.empty((n, m), dtype=torch.float8_e4m3fn, device=g.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=g.device)
    if m and n:
        bm, bn = COLS_TILE
        bf16 = g.dtype == torch.bfloat16
        sx = row_scale.to(torch.float32).reshape(-1).contiguous()
        amax = torch.zeros(n, dtype=torch.int32, device=g.device)
        nan = torch.zeros(n, dtype=torch.int32, device=g.device)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        gv = g.view(torch.int16) if bf16 else g
        with _on(g):
            _grad_cols_amax_kernel[grid](gv, sx, amax, nan, m, n, g.stride(0), BF16_BITS=bf16,
                                         BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
            _grad_cols_t_kernel[grid](gv, sx, amax, nan, codes.view(torch.uint8), scale, m, n,
                                      g.stride(0), _inv_max(FP8_E4M3_MAX),
                                      CUDA_DIV=_cuda_div(g, cuda_div), BF16_BITS=bf16,
                                      SOFT=_SOFT, BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    elif n:
        scale.fill_(1.0)
    return codes, scale
