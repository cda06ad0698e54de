"""FP8 backward GEMMs of the aligned linears (``--qrl-train-aligned-backward fp8``: the input
gradient; ``--qrl-train-aligned-wgrad fp8``: the weight gradient).

The straight-through backward of ``y = Q_a(x) @ Q_w(W)^T`` (Bengio et al. 2013; QaRL, Fan et
al. 2025) is ``dx = g @ deq Q_w(W)`` and ``dW = g^T @ deq Q_a(x)``. ``bf16`` (the default)
computes both in BF16. ``fp8`` computes the input gradient (dgrad) as an FP8 GEMM on the
weight's cached E4M3 codes, as DeepSeek-V3 does (2024, sec. 3.3, "fine-grained
quantization": E4M3 for all GEMM operands, fine-grained scales; Transformer Engine's HYBRID
format takes E5M2 for gradients instead); the weight gradient is BF16 unless ``wgrad`` (below).

With per-channel weight scales ``deq Q_w(W)[n, k] = qw[n, k] * sw[n]``, the scale lies on
the dgrad's contraction index ``n``, so it cannot be an output scale of the GEMM; it folds
into the gradient before the gradient's quantization:

    dx[m, k] = sum_n g[m, n] * sw[n] * qw[n, k]
             ~ (sum_n qg[m, n] * qw[n, k]) * sg[m],   qg, sg = Q_row(g * sw^T)

with ``Q_row`` the per-row (per-token) FP8 quantizer: ``sg[m] = amax_n |g[m, n] sw[n]| / MAX``
(``MAX`` 448 for E4M3, 57344 for E5M2; an all-zero row takes scale 1), ``qg = cast(g sw / sg)``
round-to-nearest-even, saturating. The GEMM is ``torch._scaled_mm`` (row-wise scales
``sg`` and ones) with ``B = qw`` column-major, i.e. the transposed codes ``qw^T`` ``[K, N]``
contiguous (:attr:`~.real_gemm.RealWeight.codes_t`, made once per cached weight). The
only rounding beyond the BF16 path is ``Q_row``'s (relative ``2^-4`` per element for E4M3,
``2^-3`` for E5M2) and the FP8 GEMM's fp32 accumulation. Stacked experts: each row folds its
own expert's ``sw``, then one ``torch._scaled_grouped_mm`` (:func:`grouped_dgrad_fp8`). Under
tensor parallelism a column-parallel shard quantizes the gradient over its own output
columns (the dgrad's partial sums are all-reduced after, by Megatron's mappings).

On CUDA both gradient quantizations (fold, amax, scale, codes; the wgrad's transposed) are
one fused kernel each (:mod:`megatron_qrl.quant.triton_grad`, :func:`grad_kernels`), bit for
bit the torch code here, which reads and writes the gradient in fp32 eight to ten times.

Which FP8 element type: :data:`GRAD_FORMAT` (E4M3), measured by ``bench/fp8_backward.py``
against E5M2 (docs/BENCHMARKS.md): with one scale per row, E5M2's wider range is not needed
and its one fewer mantissa bit doubles the error.

The weight gradient (wgrad, ``--qrl-train-aligned-wgrad fp8``) multiplies the forward's saved
per-token activation codes ``qx, sx = Q_a(x)`` (no second quantization of ``x``, no
dequantization). The token scale ``sx[m]`` lies on the wgrad's contraction index ``m``, so it
folds into the gradient's rows, and the folded gradient is quantized per output channel ``n``
over the tokens (``Q_col``, the same quantizer as ``Q_row`` on ``h^T``):

    dW[n, k] = sum_m g[m, n] * sx[m] * qx[m, k]
             ~ (sum_m qh[m, n] * qx[m, k]) * sh[n],   qh, sh = Q_col(g * sx)

one ``torch._scaled_mm`` with ``A = qh^T`` ``[N, M]`` row-major (row scales ``sh``) and
``B = qx`` column-major (``qx^T`` ``[K, M]`` contiguous, ones as its scales); on CUDA the
token dimension is zero-padded to a multiple of 16 (exact). Stacked experts: each expert's
rows alone (its own ``sh``), one ``_scaled_mm`` per expert with tokens (:func:`grouped_wgrad_fp8`).
Only formats whose forward saves per-token E4M3 activation codes have this GEMM
(:func:`check_fp8_wgrad`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_qrl.quant import QuantSpec

BACKWARDS = ("bf16", "fp8")
BACKWARD_FLAG = "--qrl-train-aligned-backward"
WGRAD_FLAG = "--qrl-train-aligned-wgrad"

GRAD_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""FP8 element types of the quantized gradient."""
GRAD_FORMAT = "e4m3"
"""The element type ``fp8`` uses (see the module doc)."""


def check_fp8_backward(spec: QuantSpec, gemm: str, what: str = "") -> None:
    """Raise one clear error unless the FP8 dgrad applies: the real GEMM (the cache holds the
    codes) of a format with per-channel E4M3 weight codes."""
    where = f" ({what})" if what else ""
    if gemm != "real":
        raise ValueError(f"{BACKWARD_FLAG} fp8 multiplies the real GEMM's cached FP8 codes, but "
                         f"the aligned forward runs the {gemm} GEMM{where}; use "
                         "--qrl-train-aligned-gemm real (or auto on a GPU) or "
                         f"{BACKWARD_FLAG} bf16")
    if not (spec.weight_format == "float8_e4m3fn" and spec.granularity == "channel"):
        raise ValueError(f"{BACKWARD_FLAG} fp8 needs per-channel E4M3 weight codes; "
                         f"{spec.name} has {spec.granularity} {spec.weight_format} codes{where}; "
                         f"use {BACKWARD_FLAG} bf16")


def check_fp8_wgrad(spec: QuantSpec, gemm: str, what: str = "") -> None:
    """Raise one clear error unless the FP8 wgrad applies: the real GEMM (the forward saves the
    activation codes) of a format with per-token E4M3 activation codes."""
    where = f" ({what})" if what else ""
    if gemm != "real":
        raise ValueError(f"{WGRAD_FLAG} fp8 multiplies the real GEMM's saved FP8 activation "
                         f"codes, but the aligned forward runs the {gemm} GEMM{where}; use "
                         f"--qrl-train-aligned-gemm real (or auto on a GPU) or {WGRAD_FLAG} bf16")
    if not (spec.weight_format == "float8_e4m3fn" and spec.activation == "per_token"):
        raise ValueError(f"{WGRAD_FLAG} fp8 needs per-token E4M3 activation codes; {spec.name} "
                         f"has {spec.activation} activations with {spec.weight_format} codes"
                         f"{where}; use {WGRAD_FLAG} bf16")


def transposed_codes(codes: torch.Tensor) -> torch.Tensor:
    """FP8 codes ``[..., R, C]`` transposed, contiguous ``[..., C, R]``: the column-major ``B``
    operand of ``torch._scaled_mm`` (copied as bytes: CPU float8 lacks the copy kernels)."""
    return codes.view(torch.uint8).transpose(-1, -2).contiguous().view(codes.dtype)


def quantize_grad_rows(g: torch.Tensor, fmt: str = GRAD_FORMAT, inplace: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``Q_row(g)``: FP8 codes ``[M, N]`` and fp32 scales ``[M, 1]`` of ``g`` (fp32), one
    scale per row, ``amax / MAX`` (1 for an all-zero row); round to nearest even, saturating.
    ``inplace``: ``g`` (a temporary) is divided in place (two fewer full-size tensors)."""
    dtype = GRAD_DTYPES[fmt]
    maxv = torch.finfo(dtype).max
    amax = torch.linalg.vector_norm(g, ord=float("inf"), dim=-1, keepdim=True)  # max |g|, exact
    scale = amax / maxv
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = g.div_(scale) if inplace else g / scale
    return q.clamp_(-maxv, maxv).to(dtype), scale


def grad_kernels(device: torch.device, fmt: str):
    """:mod:`megatron_qrl.quant.triton_grad` where its fused gradient quantizers run for a
    gradient on ``device`` (CUDA, or the interpreter when forced; ``QRL_QUANT_IMPL``, as the
    other fused quantizers), bit for bit :func:`quantize_grad_rows` of the folded gradient;
    None for the torch code (also for E5M2: the kernels write E4M3)."""
    if fmt != "e4m3":
        return None
    from megatron_qrl.quant.fused import module_kernels

    return module_kernels("triton_grad", device, "the gradient is on {device}")


def dgrad_operand(grad2d: torch.Tensor, scale: torch.Tensor, fmt: str,
                  row_group: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``Q_row(g * sw^T)``: the FP8 input gradient's ``A`` operand (codes ``[M, N]``, scales
    ``[M, 1]``), in one fused kernel where :func:`grad_kernels` gives one; ``row_group``
    (``[M]``, each row's expert): ``scale`` is ``[E, N]`` and each row folds its expert's."""
    kernels = grad_kernels(grad2d.device, fmt)
    if kernels is not None:
        return kernels.quantize_grad_rows(
            grad2d, scale.reshape(-1) if row_group is None else scale, row_group)
    folded = folded_grad(grad2d, scale) if row_group is None else \
        grad2d.float() * scale[row_group]
    return quantize_grad_rows(folded, fmt, inplace=True)


def folded_grad(grad2d: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``g * sw^T`` in fp32: the weight's per-channel scale ``[N, 1]`` folded into the
    gradient's columns (the dgrad's contraction index)."""
    return grad2d.float() * scale.reshape(1, -1)


def dgrad_fp8(grad2d: torch.Tensor, codes_t: torch.Tensor, scale: torch.Tensor,
              out_dtype: torch.dtype, fmt: str, mm: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``dx = g @ deq Q_w(W)`` ``[M, K]`` as one FP8 GEMM: ``Q_row(g * sw^T)`` times the codes
    (``codes_t``: ``qw^T`` ``[K, N]`` contiguous, ``scale``: ``sw`` ``[N, 1]``), see the
    module doc; ``mm(xq, xs, wq, ws, out_dtype)`` = ``(xq @ wq^T) * xs * ws^T``
    (:func:`.real_gemm.scaled_mm`: ``torch._scaled_mm``, on CUDA and on the CPU)."""
    qg, sg = dgrad_operand(grad2d, scale, fmt)
    ones = torch.ones(codes_t.shape[0], 1, dtype=torch.float32, device=codes_t.device)
    return mm(qg, sg, codes_t, ones, out_dtype)


def dgrad_fp8_reference(grad2d: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                        out_dtype: torch.dtype, fmt: str = GRAD_FORMAT) -> torch.Tensor:
    """The maths of :func:`dgrad_fp8` emulated (tests, the bench): quantize, then the GEMM in
    fp64, rounded once to ``out_dtype`` (E4M3 x E4M3 products span < 2^36 and sums of < 2^13
    of them are exact in fp64; with E5M2 gradients nearly so, relative error < 2^-50)."""
    qg, sg = quantize_grad_rows(folded_grad(grad2d, scale), fmt)
    return ((qg.double() @ codes.double()) * sg.double()).to(out_dtype)


def grouped_dgrad_fp8(grad2d: torch.Tensor, codes_t: torch.Tensor, scale: torch.Tensor,
                      counts: list[int], out_dtype: torch.dtype, fmt: str,
                      mm: Callable[..., torch.Tensor]) -> torch.Tensor:
    """:func:`dgrad_fp8` of every expert's rows: ``codes_t`` ``[E, K, N]``, ``scale``
    ``[E, N, 1]``; each row's gradient takes its expert's weight scale, then
    ``mm(xq, xs, wq, ws, counts, out_dtype=)`` (:func:`.real_gemm.grouped_real_mm`: one
    ``torch._scaled_grouped_mm`` where it runs, else one ``_scaled_mm`` per expert)."""
    group = torch.arange(len(counts), device=grad2d.device).repeat_interleave(
        torch.tensor(counts, device=grad2d.device), output_size=sum(counts))
    qg, sg = dgrad_operand(grad2d, scale.reshape(scale.shape[0], -1), fmt, group)
    ones = torch.ones(*codes_t.shape[:2], 1, dtype=torch.float32, device=codes_t.device)
    return mm(qg, sg, codes_t, ones, counts, out_dtype=out_dtype)


def folded_grad_t(grad2d: torch.Tensor, act_scale: torch.Tensor) -> torch.Tensor:
    """``(g * sx)^T`` ``[N, M]`` in fp32, contiguous: the activation's per-token scale ``[M, 1]``
    folded into the gradient's rows (the wgrad's contraction index), transposed so that
    ``Q_row`` of it is the per-output-channel ``Q_col`` of ``g * sx``."""
    folded = grad2d.to(torch.float32, copy=True).mul_(act_scale.reshape(-1, 1))
    return folded.t().contiguous()


def wgrad_fp8(grad2d: torch.Tensor, act_codes: torch.Tensor, act_scale: torch.Tensor,
              out_dtype: torch.dtype, fmt: str, mm: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``dW = g^T @ deq Q_a(x)`` ``[N, K]`` as one FP8 GEMM on the forward's saved activation
    codes (``act_codes`` ``[M, K]``, ``act_scale`` ``sx`` ``[M, 1]``): ``Q_col(g * sx)`` times
    the codes, see the module doc; ``mm`` as in :func:`dgrad_fp8`."""
    kernels = grad_kernels(grad2d.device, fmt)
    if kernels is not None:
        qh, sh = kernels.quantize_grad_cols_t(grad2d, act_scale)
    else:
        qh, sh = quantize_grad_rows(folded_grad_t(grad2d, act_scale), fmt, inplace=True)
    ones = torch.ones(act_codes.shape[1], 1, dtype=torch.float32, device=act_codes.device)
    return mm(qh, sh, transposed_codes(act_codes), ones, out_dtype)


def wgrad_fp8_reference(grad2d: torch.Tensor, act_codes: torch.Tensor, act_scale: torch.Tensor,
                        out_dtype: torch.dtype, fmt: str = GRAD_FORMAT) -> torch.Tensor:
    """The maths of :func:`wgrad_fp8` emulated: quantize, then the GEMM in fp64 rounded once to
    ``out_dtype`` (exact sums as in :func:`dgrad_fp8_reference`)."""
    qh, sh = quantize_grad_rows(folded_grad_t(grad2d, act_scale), fmt)
    return ((qh.double() @ act_codes.double()) * sh.double()).to(out_dtype)


def grouped_wgrad_fp8(grad2d: torch.Tensor, act_codes: torch.Tensor, act_scale: torch.Tensor,
                      counts: list[int], out_dtype: torch.dtype, fmt: str,
                      mm: Callable[..., torch.Tensor]) -> torch.Tensor:
    """:func:`wgrad_fp8` of every expert's rows, stacked ``[E, N, K]``: each expert's gradient
    quantized per output channel over its own tokens; an expert without tokens gets zeros."""
    n, k = grad2d.shape[1], act_codes.shape[1]
    out = grad2d.new_zeros(len(counts), n, k, dtype=out_dtype)
    start = 0
    for e, c in enumerate(counts):
        if c:
            rows = slice(start, start + c)
            out[e] = wgrad_fp8(grad2d[rows], act_codes[rows], act_scale[rows], out_dtype, fmt, mm)
        start += c
    return out
