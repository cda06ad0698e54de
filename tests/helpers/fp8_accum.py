"""How far an FP8 tensor-core GEMM may be from the exact sum (no tests here): the bound that
tests/gpu/test_real_gemm.py holds the H200's FP8 GEMMs to, and an emulation of the accumulator
that tests/te_quant/test_fp8_accum.py checks the bound against on the CPU.

Hopper's FP8 MMA (``wgmma`` with E4M3 / E5M2 operands, ``K = 32`` per instruction) does not
accumulate in IEEE fp32: its accumulator keeps 13 fraction bits and truncates (Khattak and
Mikaitis 2025, "Accurate Models of NVIDIA Tensor Cores", arXiv:2512.07004, the H100 FP8 model;
DeepSeek-AI 2024, DeepSeek-V3 technical report sec. 3.3.2: "around 14 bits"). CUTLASS's FP8
kernels without fast accumulation add that accumulator into fp32 registers every 128 K
elements (``mma_promotion_interval`` 4); with fast accumulation (SGLang's ``fp8_scaled_mm``
on sm90) never. The bound below assumes no promotion at all, so it holds for both.

Model of one instruction: the accumulator ``c`` and the ``b`` products ``t_k`` of a K block
are added with every addend truncated below bit ``E - 13`` (``2^E <= max |addend|``, the
alignment) and the sum normalized and truncated to 13 fraction bits, in any grouping of
sub-blocks. Each truncation loses less than ``2^-13`` of a magnitude no larger than
``|P_{j-1}| + sum_{k in block j} |t_k|`` (``P_{j-1}``: the exact sum of the blocks before;
the accumulated error is of second order), at most ``2 (b + 1)`` truncations per block, so

    |acc - sum_k t_k| <= 2 (b + 1) 2^-13 sum_j (|P_{j-1}| + sum_{k in j} |t_k|)    (1)

(the recursive-summation bound, Higham 2002, "Accuracy and Stability of Numerical
Algorithms", sec. 4.2, with unit roundoff ``2^-13`` and ``b + 1`` addends per step). The
epilogue multiplies the row scale in fp32 (``2^-23`` relative for the two products) and rounds
once to BF16 (``2^-8`` relative), so the output is within
``(E_acc |s| + 2^-22 |exact|)(1 + 2^-8) + 2^-8 |exact|`` of ``exact = (A @ B) s``.
"""

from __future__ import annotations

import torch

ACC_FRACTION_BITS = 13
"""Fraction bits the FP8 MMA accumulator keeps (truncating)."""
MMA_K = 32
"""Products per FP8 ``wgmma`` instruction along K."""


def _blocks(length: int, size: int):
    return [slice(s, min(s + size, length)) for s in range(0, length, size)]


def accumulation_bound(a: torch.Tensor, b: torch.Tensor, block: int = MMA_K) -> torch.Tensor:
    """Equation (1) of the module doc for ``a @ b`` (``[M, L] @ [L, P]``, codes as fp64):
    the most the truncating accumulator can be from the exact sum, fp64 ``[M, P]``."""
    a, b = a.double(), b.double()
    bound = a.new_zeros(a.shape[0], b.shape[1])
    prefix = torch.zeros_like(bound)
    for blk in _blocks(a.shape[1], block):
        bound += prefix.abs() + a[:, blk].abs() @ b[blk].abs()
        prefix += a[:, blk] @ b[blk]
    return 2 * (block + 1) * 2.0 ** -ACC_FRACTION_BITS * bound


def fp8_gemm_bound(a: torch.Tensor, b: torch.Tensor, row_scale: torch.Tensor,
                   exact: torch.Tensor) -> torch.Tensor:
    """``|got - exact|`` bound of ``got = bf16((a @ b) * row_scale)`` from an FP8 tensor-core
    GEMM (module doc), ``exact`` the fp64 value of ``(a @ b) * row_scale``."""
    acc = accumulation_bound(a, b) * row_scale.double().abs()
    return (acc + 2.0 ** -22 * exact.abs()) * (1 + 2.0 ** -8) + 2.0 ** -8 * exact.abs()


def _truncate(x: torch.Tensor, exponent: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` truncated toward zero to a multiple of ``2^(exponent - bits)`` (fp64, exact)."""
    step = torch.exp2(exponent - bits)
    return torch.trunc(x / step) * step


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2 |x|)`` (0 where ``x`` is 0)."""
    return torch.where(x != 0, torch.floor(torch.log2(x.abs())), torch.zeros_like(x))


def truncating_gemm(a: torch.Tensor, b: torch.Tensor, block: int = MMA_K,
                    bits: int = ACC_FRACTION_BITS) -> torch.Tensor:
    """``a @ b`` through the accumulator the module doc models (one fused, aligned, truncated
    addition of ``c`` and ``block`` products per instruction, no promotion): fp64 holding the
    accumulator's values. ``block=1``: one product per step (sequential)."""
    a, b = a.double(), b.double()
    acc = a.new_zeros(a.shape[0], b.shape[1])
    for blk in _blocks(a.shape[1], block):
        terms = torch.cat([acc[:, None], a[:, blk, None] * b[None, blk]], dim=1)
        top = _exponent(terms.abs().amax(dim=1, keepdim=True))
        total = _truncate(terms, top, bits).sum(dim=1)
        acc = _truncate(total, _exponent(total), bits)
    return acc
