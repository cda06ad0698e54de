"""Fused Triton kernels of :func:`~megatron_qrl.losses.logprobs.chunked_log_probs`: the
logits are read in their own dtype (e.g. BF16), once by the forward and once by the backward,
and no fp32 ``[rows, V / TP]`` temporary is made.

Forward (:func:`row_stats`): one program per row streams its vocabulary slice in blocks and
keeps the online softmax statistics of ``z = x / T`` (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax", algorithm 3), extended by the entropy's sum:

    m_b = max(m_{b-1}, max_block z)
    S_b = S_{b-1} e^{m_{b-1} - m_b} + sum_block e^{z - m_b}
    W_b = e^{m_{b-1} - m_b} (W_{b-1} + (m_{b-1} - m_b) S_{b-1}) + sum_block e^{z - m_b} (z - m_b)

so that at the end ``S = sum_v e^{z_v - m}`` and ``W = sum_v e^{z_v - m} (z_v - m)`` about the
row's (slice's) own max ``m``; it also returns ``z`` at the target index. The caller rescales
these to the tensor-parallel max and all-reduces them as the torch path does.

Backward (:func:`grad_logits`): one program per (row, vocabulary block) writes
``d log p(y) / d x_v = (onehot(y)_v - softmax(z)_v) g / T`` with ``softmax(z)_v =
exp(z_v - logsumexp(z))`` recomputed from the saved ``logsumexp`` (Bridle 1990), in the
logits' dtype. Row offsets are 64-bit: ``[16384, 151936]`` has more than 2^31 elements.

Imported only where Triton is installed (:mod:`.logprobs` chooses); under
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (the tests' mode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["BLOCK", "NUM_WARPS", "grad_logits", "row_stats"]

BLOCK = 4096
"""Vocabulary elements per block of both kernels (a power of two)."""
NUM_WARPS = 8
"""Warps per program of both kernels (``bench/logprob_kernel.py --configs`` compares others)."""

_NEG_START = -3.0e38
"""The running max before the first block: finite, so ``(m_0 - m_1) S_0`` is ``0``, not NaN."""


@triton.jit
def _row_stats_kernel(x_ptr, idx_ptr, m_ptr, s_ptr, w_ptr, zy_ptr, stride, V, inv_t,
                      NEG_START: tl.constexpr, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    m = tl.full([], NEG_START, tl.float32)
    s = tl.zeros([], tl.float32)
    w = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        c = start + cols
        mask = c < V
        z = tl.load(base + c, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        a = tl.exp(m - m_new)
        d = tl.where(mask, z - m_new, 0.0)
        e = tl.where(mask, tl.exp(d), 0.0)
        if ENTROPY:
            w = a * (w + (m - m_new) * s) + tl.sum(e * d, 0)
        s = s * a + tl.sum(e, 0)
        m = m_new
    zy = tl.load(base + tl.load(idx_ptr + row)).to(tl.float32) * inv_t
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(w_ptr + row, w)
    tl.store(zy_ptr + row, zy)


@triton.jit
def _grad_kernel(x_ptr, out_ptr, lse_ptr, g_ptr, tgt_ptr, stride, V, inv_t,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < V
    x = tl.load(x_ptr + row * stride + c, mask=mask, other=0.0)
    p = tl.exp(x.to(tl.float32) * inv_t - tl.load(lse_ptr + row))  # softmax(z)
    g = tl.load(g_ptr + row)
    hit = c == tl.load(tgt_ptr + row)
    grad = p * -g + tl.where(hit, g, 0.0)
    tl.store(out_ptr + row * V + c, grad.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: Tensor) -> Tensor:
    """``x`` ``[rows, V]`` with unit stride along the vocabulary (a copy only where not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def row_stats(x: Tensor, idx: Tensor, temperature: float, entropy: bool,
              block: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(m, S, W, z_idx)``, fp32 ``[rows]``, of ``z = x / T`` for logits ``x`` ``[rows, V]``
    (module docstring; ``W`` is zeros unless ``entropy``); ``idx`` ``[rows]``: a column of
    each row (the target, clamped into the slice). ``block``: a power of two (default
    :data:`BLOCK`, read at call time)."""
    x, block = _rows(x), block or BLOCK
    n, v = x.shape
    out = torch.empty(4, n, dtype=torch.float32, device=x.device)
    if n:
        _row_stats_kernel[(n,)](x, idx.contiguous(), out[0], out[1], out[2], out[3],
                                x.stride(0), v, 1.0 / temperature, NEG_START=_NEG_START,
                                BLOCK=block, ENTROPY=entropy, num_warps=NUM_WARPS)
    return out[0], out[1], out[2], out[3]


def grad_logits(x: Tensor, lse: Tensor, g: Tensor, target: Tensor, temperature: float,
                block: int | None = None) -> Tensor:
    """``(onehot(target) - exp(x / T - lse)) * g`` in ``x``'s dtype, contiguous ``[rows, V]``.

    ``lse``, ``g`` fp32 ``[rows]`` (``g`` already divided by ``T``); ``target`` ``[rows]``:
    the target's column in this slice, ``-1`` where it lies in another rank's slice."""
    block = block or BLOCK
    x = _rows(x)
    n, v = x.shape
    out = torch.empty((n, v), dtype=x.dtype, device=x.device)
    if n and v:
        grid = (n, triton.cdiv(v, block))
        _grad_kernel[grid](x, out, lse.contiguous(), g.contiguous(), target.contiguous(),
                           x.stride(0), v, 1.0 / temperature, BLOCK=block,
                           num_warps=NUM_WARPS)
    return out
