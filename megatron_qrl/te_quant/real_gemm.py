"""Real low-bit GEMMs of the aligned forward: the rollout's codes and scales as the GEMM's operands.

The aligned forward (QaRL, Fan et al. 2025) computes ``y = Q_a(x) @ Q_w(W)^T``. The fake path
dequantizes both operands to BF16 and runs a BF16 GEMM; the real path multiplies the codes
and applies the scales after the integer / FP8 accumulation, as the engine's W8A8 kernels do
(SGLang ``fp8_scaled_mm`` / ``int8_scaled_mm``):

    y[m, n] = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n]

with ``qx, sx = spec.quantize_activation(x)`` (per token) and ``qw, sw`` the spec's
``quantize_weight`` (per output channel). The two paths differ only by the BF16 rounding
of the dequantized operands in the fake path (unit roundoff ``2^-9`` each) and of the
output. fp8_block runs SGLang's own kernels on the same codes (:mod:`.block_gemm`: 128x128
weight blocks, 1x128 activation groups), so its forward is the rollout's GEMM by
construction. The backward is the fake path's straight-through BF16 backward (Bengio et al. 2013)
on the same dequantized operands, recomputed from the codes, so gradients are bit-equal: two
GEMMs per linear (dgrad, wgrad), the weight dequantized per micro batch or kept once per
optimizer step (``keep_dequantized``, :class:`RealWeight`).

Which GEMM runs is decided once, by :func:`select_gemm` (format fields x device x
``--qrl-train-aligned-gemm``):

=================  ============================  =====================================
format             real GEMM                     device
=================  ============================  =====================================
fp8 (channel)      ``torch._scaled_mm`` rowwise  CUDA sm >= 89 (CPU when forced)
int8 (channel)     ``torch._int_mm`` + scales    CUDA (CPU when forced)
fp8_block          SGLang's own block-FP8 GEMM   CUDA sm >= 89 with SGLang importable
                   (``block_gemm``; experts:     (its Triton kernels); experts keep
                   fake)                         the fake path
w4a16, nvfp4       none yet: fake                weight-only / FP4: dequantize + BF16
=================  ============================  =====================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import torch
import torch.distributed as dist

from megatron_qrl.quant import QuantizedWeight, QuantSpec
from megatron_qrl.quant.finite_checks import FiniteChecks
from megatron_qrl.te_quant import fp8_backward
from megatron_qrl.te_quant.block_gemm import (
    block_scaled_mm,
    dequantize_groups,
    quantize_act_groups,
    sglang_available,
)

GEMM_MODES = ("auto", "fake", "real")
FLAG = "--qrl-train-aligned-gemm"


@dataclass(frozen=True)
class DeviceInfo:
    """Where the trainer's GEMMs run: ``cpu`` or ``cuda`` with its compute capability."""

    kind: str = "cpu"
    capability: tuple[int, int] | None = None


def device_info() -> DeviceInfo:
    """This process's trainer device (CUDA when available)."""
    if torch.cuda.is_available():
        return DeviceInfo("cuda", torch.cuda.get_device_capability())
    return DeviceInfo("cpu")


@dataclass(frozen=True)
class GemmChoice:
    """``real`` or ``fake`` and why."""

    gemm: str
    reason: str


def _kernel_key(spec: QuantSpec) -> tuple[str | None, str]:
    """(key of :data:`KERNELS` or None, reason) by the format's fields; pure."""
    if not spec.quantizes_weights:
        return None, f"{spec.name} holds BF16 weights"
    if spec.granularity == "block" and spec.activation == "per_token_group":
        key = f"{spec.weight_format}:block"
    elif spec.granularity == "channel" and spec.activation == "per_token":
        key = spec.weight_format
    else:  # weight-only (w4a16) / FP4 (nvfp4): Hopper has no such tensor-core GEMM from torch
        return None, f"{spec.name}: weight-only / FP4 formats dequantize into a BF16 GEMM"
    if key not in KERNELS:
        return None, f"{spec.name}: no real GEMM for weight format {key}"
    return key, KERNELS[key].what


def engine_kernels() -> tuple[bool, str]:
    """(SGLang's block-FP8 kernels import in this process, which module or why not)."""
    return sglang_available()


def _real_support(spec: QuantSpec, device: DeviceInfo | None) -> tuple[str | None, str]:
    """(kernel name or None, reason) for ``spec`` on ``device`` (None: any device, only
    whether the kernel exists here); pure but for the SGLang import check."""
    key, reason = _kernel_key(spec)
    if key is None:
        return None, reason
    kernel = KERNELS[key]
    if kernel.engine:
        ok, why = engine_kernels()
        if not ok:
            return None, f"{spec.name}: needs SGLang's block-FP8 kernels, not importable ({why})"
        if device is not None and device.kind != "cuda":
            return None, f"{spec.name}: SGLang's block-FP8 GEMM is a CUDA Triton kernel (CPU)"
    if (device is not None and device.kind == "cuda"
            and (device.capability or (0, 0)) < kernel.min_capability):
        return None, (f"{spec.weight_format} GEMMs need CUDA sm >= "
                      f"{''.join(map(str, kernel.min_capability))}, this GPU is sm "
                      f"{device.capability}")
    return key, reason


def select_gemm(spec: QuantSpec, device: DeviceInfo, mode: str = "auto") -> GemmChoice:
    """Which GEMM the aligned linears run for ``spec`` on ``device`` (pure; see module table).

    ``auto``: real where a kernel exists on a GPU, else fake (the CPU keeps fake); ``real``:
    the real GEMM where torch has it (also on the CPU), else a clear error naming the flag.
    """
    if mode not in GEMM_MODES:
        raise ValueError(f"{FLAG} must be one of {GEMM_MODES}, got {mode!r}")
    if mode == "fake":
        return GemmChoice("fake", f"{FLAG} fake")
    kernel, reason = _real_support(spec, device)
    if mode == "real":
        if kernel is None:
            raise ValueError(f"{FLAG} real: {reason}; use {FLAG} auto or fake")
        return GemmChoice("real", reason)
    if kernel is None or device.kind != "cuda":
        return GemmChoice("fake", reason if kernel is None else "CPU: fake quantization")
    return GemmChoice("real", reason)


# ---- the GEMMs -------------------------------------------------------------------------------
def _pad(t: torch.Tensor, dim: int, multiple: int, minimum: int = 0) -> torch.Tensor:
    """``t`` with zero rows / columns appended along ``dim`` up to a multiple (exact: zero
    codes add nothing to the integer / FP8 sums)."""
    size = t.shape[dim]
    target = max(-(-size // multiple) * multiple, minimum)
    if target == size:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, target - size]
    return torch.nn.functional.pad(t, pad)


FAST_ACCUM = True
"""The forward's FP8 GEMMs on CUDA accumulate as the engine's do: SGLang's ``fp8_scaled_mm`` on
sm90 runs CUTLASS's ``FP8FastAccum`` schedules (the whole K in the tensor core's accumulator,
13 fraction bits, truncating: ``tests/helpers/fp8_accum.py``), so ``torch._scaled_mm`` runs
with ``use_fast_accum`` (its default adds the accumulator into fp32 every 128 K elements:
another sum, which on the H200 left the real forward's logits 0.067 from the exact GEMM's where
the fake path's were 0.077). The FP8 input gradient (:mod:`.fp8_backward`) keeps the
promoted, more accurate sum (``fast_accum=False``)."""


def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
              out_dtype: torch.dtype, cuda_shapes: bool | None = None,
              fast_accum: bool = FAST_ACCUM) -> torch.Tensor:
    """``(xq @ wq^T) * xs * ws^T`` of FP8 E4M3 codes: ``torch._scaled_mm`` with row-wise fp32
    scales ``xs`` ``[M, 1]``, ``ws`` ``[N, 1]``. On CUDA K and N are zero-padded to multiples
    of 16 (the kernel's alignment) where needed, the accumulation is the engine's
    (``fast_accum``, :data:`FAST_ACCUM`), and the output is BF16 (the row-wise kernel's only
    output type) cast to ``out_dtype``. ``cuda_shapes`` (default: on CUDA) forces the
    padding."""
    m, n = xq.shape[0], wq.shape[0]
    if m == 0:  # an expert without tokens (the kernel refuses an empty scale's strides)
        return xq.new_zeros((0, n), dtype=out_dtype)
    pad = xq.is_cuda if cuda_shapes is None else cuda_shapes
    dtype = torch.bfloat16 if xq.is_cuda else out_dtype
    if pad and (xq.shape[1] % 16 or n % 16):
        xq, wq = _pad(xq, 1, 16), _pad(_pad(wq, 1, 16), 0, 16)
        ws = _pad(ws, 0, 16)
    y = torch._scaled_mm(xq, wq.t(), scale_a=xs.contiguous(), scale_b=ws.reshape(1, -1),
                         out_dtype=dtype, use_fast_accum=fast_accum and xq.is_cuda)
    return y[:m, :n].to(out_dtype)


def int_mm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
           out_dtype: torch.dtype, cuda_shapes: bool | None = None) -> torch.Tensor:
    """``(xq @ wq^T) * xs * ws^T`` of INT8 codes: ``torch._int_mm`` (int32, exact) then the fp32
    scales, as SGLang's ``int8_scaled_mm``. On CUDA (M > 16, K and N multiples of 8) the
    operands are zero-padded where needed (``cuda_shapes``, default: on CUDA)."""
    m, n = xq.shape[0], wq.shape[0]
    if xq.is_cuda if cuda_shapes is None else cuda_shapes:
        xq = _pad(_pad(xq, 1, 8), 0, 8, minimum=32)
        wq = _pad(_pad(wq, 1, 8), 0, 8)
    acc = torch._int_mm(xq, wq.t())[:m, :n]
    return (acc.float() * xs * ws.reshape(1, -1)).to(out_dtype)


@dataclass(frozen=True)
class Kernel:
    """A real GEMM of codes and scales: ``fn(xq, xs, wq, ws, out_dtype)``."""

    fn: Callable[..., torch.Tensor]
    min_capability: tuple[int, int]
    """Lowest CUDA compute capability with the kernel (the CPU has torch's)."""
    what: str
    engine: bool = False
    """The rollout engine's own kernel (SGLang's, CUDA only): block scales, activation
    groups quantized by the engine's kernel, no grouped-experts form (experts stay fake)."""


KERNELS: dict[str, Kernel] = {
    "float8_e4m3fn": Kernel(scaled_mm, (8, 9), "torch._scaled_mm (row-wise scales)"),
    "int8": Kernel(int_mm, (0, 0), "torch._int_mm (int32 accumulate) + fp32 scales"),
    "float8_e4m3fn:block": Kernel(
        block_scaled_mm, (8, 9), "SGLang per_token_group_quant_fp8 + "
        "w8a8_block_fp8_matmul_triton (the engine's kernels; experts: fake, SGLang runs them "
        "through its fused-MoE kernel)", engine=True),
}
"""Code element type (``QuantSpec.weight_format``) -> its real GEMM: a fact of the hardware
and torch, shared by every per-channel / per-token format of that element type."""


def kernel_for(spec: QuantSpec) -> Callable[..., torch.Tensor]:
    """The real GEMM of ``spec``'s codes (by its fields, not its name)."""
    key, reason = _real_support(spec, None)
    if key is None:
        raise ValueError(f"{FLAG} real: {reason}")
    if KERNELS[key].engine:
        return partial(KERNELS[key].fn, block=tuple(spec.block))
    return KERNELS[key].fn


def experts_gemm(spec: QuantSpec, gemm: str) -> tuple[str, str]:
    """(GEMM of the experts' linears, why) when the dense linears run ``gemm``: the engine's
    block kernels have no grouped form here (SGLang runs experts through its fused-MoE
    Triton kernel, another API), so block formats keep the fake path for experts."""
    if gemm == "real" and _kernel_key(spec)[0] is not None and \
            KERNELS[_kernel_key(spec)[0]].engine:
        return "fake", (f"{spec.name} experts: SGLang's fused-MoE block-FP8 kernel is not "
                        "wired in; experts keep the fake path")
    return gemm, f"experts follow the linears ({gemm})"


# ---- operands --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RealWeight:
    """The cached GEMM operand of one weight: ``codes`` ``[N, K]`` and fp32 ``scale`` ``[N, 1]``
    (per channel) or ``[ceil(N/128), ceil(K/128)]`` (fp8_block's ``weight_scale_inv``) exactly
    as ``spec.quantize_weight`` gives them (the rollout's tensors)."""

    codes: torch.Tensor
    scale: torch.Tensor
    keep_dequantized: bool = False
    """The backward keeps ``deq Q_w(W)`` (:meth:`grad_weight`) for the rest of this cached
    weight's life, one optimizer step: 2 bytes per weight element more, no dequantization
    per micro batch (:attr:`~.state.AlignedForwardState.keep_dequantized`)."""

    def grad_weight(self, spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
        """``deq Q_w(W)`` in ``dtype``, the straight-through input gradient's operand: made per
        call, or once and kept with this cached weight where :attr:`keep_dequantized`."""
        if not self.keep_dequantized:
            return self.dequantize(spec, dtype)
        kept = self.__dict__.setdefault("_dequantized", {})
        if dtype not in kept:
            kept[dtype] = self.dequantize(spec, dtype)
        return kept[dtype]

    def dequantize(self, spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
        """``codes * scale`` in ``dtype``: ``spec.quantize_dequantize(W)``, bit for bit (one
        fused kernel where ``spec.dequantize_rows`` picks it; blocks: ``spec.dequantize``)."""
        if spec.granularity == "block":
            q = QuantizedWeight(spec.name, self.codes, self.scale, None,
                                tuple(self.codes.shape), dtype)
            return spec.dequantize(q, dtype)
        return spec.dequantize_rows(self.codes, self.scale, dtype)

    @cached_property
    def codes_t(self) -> torch.Tensor:
        """The codes transposed, contiguous (``[K, N]``; experts ``[E, K, N]``): the
        column-major ``B`` operand of the FP8 input-gradient GEMM
        (:mod:`.fp8_backward`), made on first use and dropped with this cached weight
        (one byte per weight element while ``--qrl-train-aligned-backward fp8`` runs)."""
        return fp8_backward.transposed_codes(self.codes)


def dequantize_activation(spec: QuantSpec, codes: torch.Tensor, scale: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """The saved activation codes times their scales (per token, or per 1x128 group)."""
    if spec.activation == "per_token_group":
        return dequantize_groups(codes, scale, dtype)
    return spec.dequantize_rows(codes, scale, dtype)


def _gather_last(t: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1), dist.get_rank(group)


def _split_dim(group, parallel_dim: int, spec: QuantSpec | None = None) -> bool:
    """True if the operand's input features are split over a tensor-parallel group of > 1
    and its scales span the whole row (per channel / per token; a 128-column block or group
    lies inside one shard, the shard's width being a multiple of 128)."""
    if spec is not None and spec.granularity == "block":
        return False
    return (parallel_dim == 1 and group is not None and dist.is_initialized()
            and dist.get_world_size(group) > 1)


def check_block_layout(spec: QuantSpec, n: int, layout, name: str) -> None:
    """Raise unless quantizing the fused ``[n, K]`` weight in 128-row blocks equals
    quantizing each HF component (what the engine holds): every fused segment (q/k/v heads of
    a query group, gate / up halves) must span whole blocks."""
    if spec.granularity != "block" or layout is None or layout.kind == "plain":
        return
    rows = spec.block[0]
    seg = layout.head_dim if layout.kind == "qkv" else n // 2
    if seg % rows:
        raise ValueError(
            f"{FLAG} real: {spec.name} {name}: a fused {layout.kind} segment of {seg} rows "
            f"is not a multiple of the {rows}-row blocks, so the fused GEMM's blocks are not "
            f"the engine's; use {FLAG} fake")


def weight_operand(spec: QuantSpec, w: torch.Tensor, parallel_dim: int = 0, group=None,
                   name: str = "weight", layout=None, finite: FiniteChecks | None = None
                   ) -> RealWeight:
    """Codes and scales of this rank's shard: rows are whole on a column-parallel shard; a
    row-parallel shard's per-channel scale spans all ranks (gathered once, codes narrowed);
    blocks lie inside a shard (``layout``: the fused HF components, checked for blocks).
    ``finite``: where the weight's finiteness goes (the refresh's
    :class:`~megatron_qrl.quant.finite_checks.FiniteChecks`) instead of a host sync now."""
    check_block_layout(spec, w.shape[0], layout, name)
    if _split_dim(group, parallel_dim, spec):
        full, rank = _gather_last(w.detach(), group)
        q = spec.quantize_weight(full, name=name, finite=finite)
        k = w.shape[1]
        return RealWeight(q.codes.narrow(1, rank * k, k).contiguous(), q.scale)
    q = spec.quantize_weight(w, name=name, finite=finite)
    return RealWeight(q.codes, q.scale)


def activation_operand(spec: QuantSpec, x2d: torch.Tensor, parallel_dim: int = 0, group=None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token codes and scales of a ``[M, K]`` input; a row-parallel input's token scale
    spans all ranks' features (gathered, codes narrowed), as the fake path's. Per-token-group
    formats: SGLang's own quantizer (:func:`.block_gemm.quantize_act_groups`), groups local."""
    if spec.activation == "per_token_group":
        return quantize_act_groups(spec, x2d)
    if _split_dim(group, parallel_dim):
        full, rank = _gather_last(x2d.detach(), group)
        codes, scale = spec.quantize_activation(full)
        k = x2d.shape[1]
        return codes.narrow(1, rank * k, k).contiguous(), scale
    return spec.quantize_activation(x2d)


# ---- autograd: the real forward, the fake path's straight-through BF16 backward ------------
class RealLinearFn(torch.autograd.Function):
    """``y = gemm(Q_a(x), Q_w(W))`` with the real kernel; backward as the fake path's linear
    (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` without fusion):
    ``dx = g @ deq(Q_w)``, ``dW = g^T @ deq(Q_a(x))`` (STE), from the saved codes.

    The straight-through estimator (Bengio et al. 2013; docs/ALGORITHMS.md) passes the gradient
    through the quantizers, not through the GEMM: ``dy/dx`` of ``y = Q_a(x) Q_w(W)^T`` is
    ``deq Q_w(W)``, the weight the forward multiplied, not the master ``W`` (the fake path's
    autograd takes the same). So the weight is dequantized per backward call (one fused kernel
    reading its codes, :meth:`QuantSpec.dequantize_rows`) or once per optimizer step where the
    cache keeps it (:meth:`RealWeight.grad_weight`).
    ``grad_fp8`` (an FP8 element type of :data:`.fp8_backward.GRAD_DTYPES`): ``dx`` is the FP8
    GEMM of :func:`.fp8_backward.dgrad_fp8` on the cached codes instead; ``wgrad_fp8``: ``dW``
    is the FP8 GEMM of :func:`.fp8_backward.wgrad_fp8` on the saved activation codes."""

    @staticmethod
    def forward(ctx, x, weight, qw, spec, parallel_dim, group, grad_fp8=None,  # noqa: D401
                wgrad_fp8=None):
        k = x.shape[-1]
        xq, xs = activation_operand(spec, x.reshape(-1, k), parallel_dim, group)
        y = kernel_for(spec)(xq, xs, qw.codes, qw.scale, x.dtype)
        ctx.save_for_backward(xq, xs)
        ctx.qw, ctx.spec, ctx.x_shape, ctx.grad_fp8 = qw, spec, x.shape, grad_fp8
        ctx.wgrad_fp8 = wgrad_fp8
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        xq, xs = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0] and ctx.grad_fp8:
            g2d = grad.reshape(-1, grad.shape[-1])
            grad_x = fp8_backward.dgrad_fp8(g2d, ctx.qw.codes_t, ctx.qw.scale, grad.dtype,
                                            ctx.grad_fp8, partial(scaled_mm, fast_accum=False)
                                            ).view(*grad.shape[:-1], -1)
        elif ctx.needs_input_grad[0]:
            grad_x = grad.matmul(ctx.qw.grad_weight(ctx.spec, grad.dtype))
        if ctx.needs_input_grad[1] and ctx.wgrad_fp8:
            g2d = grad.reshape(-1, grad.shape[-1])
            grad_w = fp8_backward.wgrad_fp8(g2d, xq, xs, grad.dtype, ctx.wgrad_fp8,
                                            partial(scaled_mm, fast_accum=False))
        elif ctx.needs_input_grad[1]:
            g2d = grad.reshape(-1, grad.shape[-1])
            grad_w = g2d.t().matmul(dequantize_activation(ctx.spec, xq, xs, grad.dtype))
        return grad_x, grad_w, None, None, None, None, None, None


def real_linear(x: torch.Tensor, weight: torch.Tensor, qw: RealWeight, spec: QuantSpec,
                parallel_dim: int = 0, group=None, grad_fp8: str | None = None,
                wgrad_fp8: str | None = None) -> torch.Tensor:
    """``x @ W^T`` of the aligned forward through the real low-bit GEMM (see
    :class:`RealLinearFn`); ``grad_fp8`` (``e4m3`` / ``e5m2``; None: BF16): the input gradient
    as an FP8 GEMM (:mod:`.fp8_backward`); ``wgrad_fp8``: the weight gradient likewise."""
    if grad_fp8:
        fp8_backward.check_fp8_backward(spec, "real")
    if wgrad_fp8:
        fp8_backward.check_fp8_wgrad(spec, "real")
    return RealLinearFn.apply(x, weight, qw, spec, parallel_dim, group, grad_fp8, wgrad_fp8)


def _scaled_grouped_ok(xq: torch.Tensor, wq: torch.Tensor) -> bool:
    """``torch._scaled_grouped_mm`` takes these FP8 operands: CUDA sm 9.x (its kernel's
    architecture), K and N multiples of 16."""
    return (hasattr(torch, "_scaled_grouped_mm") and xq.is_cuda and xq.dtype == torch.float8_e4m3fn
            and torch.cuda.get_device_capability(xq.device)[0] == 9
            and xq.shape[1] % 16 == 0 and wq.shape[1] % 16 == 0)


def grouped_real_mm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                    counts: list[int], fn: Callable[..., torch.Tensor], out_dtype: torch.dtype,
                    fast_accum: bool = FAST_ACCUM) -> torch.Tensor:
    """``cat_e(fn(xq_e, wq[e]))`` over the experts' row groups: one
    ``torch._scaled_grouped_mm`` for FP8 where it runs (``fast_accum``: :data:`FAST_ACCUM`),
    else one real GEMM ``fn`` per expert."""
    if _scaled_grouped_ok(xq, wq):
        from megatron_qrl.models.grouped_gemm import group_offsets

        return torch._scaled_grouped_mm(
            xq, wq.transpose(1, 2), scale_a=xs.reshape(-1).contiguous(),
            scale_b=ws.reshape(wq.shape[0], -1).contiguous(),
            offs=group_offsets(counts, xq.device), out_dtype=out_dtype,
            use_fast_accum=fast_accum)
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            out.append(fn(xq[start:start + c], xs[start:start + c], wq[e], ws[e], out_dtype))
        start += c
    if not out:
        return xq.new_zeros(0, wq.shape[1], dtype=out_dtype)
    return torch.cat(out, dim=0)


class GroupedRealFn(torch.autograd.Function):
    """Grouped experts through the real GEMM; backward: the gradients of the fake path's grouped
    GEMM (:func:`megatron_qrl.models.grouped_gemm.grouped_mm`) on the dequantized operands,
    bit for bit, as its two GEMMs only (:func:`.grouped_gemm.grouped_mm_grads`: no forward GEMM
    run again): ``dx`` from ``deq Q_w(W)`` (:meth:`RealWeight.grad_weight`), ``dW`` from the
    saved activation codes dequantized. The masters are one stacked ``[E, N, K]`` weight or
    one ``[N, K]`` weight per expert (the gradient is unbound into them, no stacked copy of the
    masters). ``grad_fp8``: the input gradient from :func:`.fp8_backward.grouped_dgrad_fp8`
    instead (the weight is then not dequantized); ``wgrad_fp8``: the weight gradient from
    :func:`.fp8_backward.grouped_wgrad_fp8` on the saved codes (not dequantized)."""

    @staticmethod
    def forward(ctx, x, qw, spec, counts, parallel_dim, group, grad_fp8, wgrad_fp8,  # noqa: D401
                *masters):
        xq, xs = activation_operand(spec, x, parallel_dim, group)
        y = grouped_real_mm(xq, xs, qw.codes, qw.scale, counts, kernel_for(spec), x.dtype)
        ctx.save_for_backward(xq, xs)
        ctx.qw, ctx.spec, ctx.counts, ctx.grad_fp8 = qw, spec, counts, grad_fp8
        ctx.wgrad_fp8 = wgrad_fp8
        ctx.stacked = len(masters) == 1 and masters[0].dim() == 3
        return y

    @staticmethod
    def backward(ctx, grad):
        from megatron_qrl.te_quant.grouped_gemm import grouped_mm_grads

        xq, xs = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[8:])
        fp8_dx, fp8_dw = bool(ctx.grad_fp8) and need_x, bool(ctx.wgrad_fp8) and need_w
        x = dequantize_activation(ctx.spec, xq, xs, grad.dtype) if need_w and not fp8_dw \
            else None
        w = ctx.qw.grad_weight(ctx.spec, grad.dtype) if need_x and not fp8_dx else None
        gx, gw = grouped_mm_grads(x, w, grad, ctx.counts) if x is not None or w is not None \
            else (None, None)
        if fp8_dx:
            gx = fp8_backward.grouped_dgrad_fp8(grad, ctx.qw.codes_t, ctx.qw.scale, ctx.counts,
                                                grad.dtype, ctx.grad_fp8,
                                                partial(grouped_real_mm, fast_accum=False,
                                                        fn=partial(scaled_mm, fast_accum=False)))
        if fp8_dw:
            gw = fp8_backward.grouped_wgrad_fp8(grad, xq, xs, ctx.counts, grad.dtype,
                                                ctx.wgrad_fp8, partial(scaled_mm, fast_accum=False))
        n = len(ctx.needs_input_grad) - 8
        gws = (gw,) if ctx.stacked else (gw.unbind(0) if gw is not None else (None,) * n)
        return (gx, None, None, None, None, None, None, None, *gws)


def grouped_real_linear(x: torch.Tensor, masters: list[torch.Tensor], qw: RealWeight,
                        spec: QuantSpec, counts: list[int], parallel_dim: int = 0,
                        group=None, grad_fp8: str | None = None,
                        wgrad_fp8: str | None = None) -> torch.Tensor:
    """``cat_e(Q_a(x_e) @ Q_w(W_e)^T)`` through the real GEMM; ``masters`` (one stacked
    ``[E, N, K]`` weight or one weight per expert) receive the straight-through gradient
    (:class:`GroupedRealFn`); ``parallel_dim`` 1 with an expert-TP ``group``: the input's
    features are split, token scales taken over the gathered row; ``grad_fp8``: the input
    gradient as FP8 GEMMs (:func:`.fp8_backward.grouped_dgrad_fp8`); ``wgrad_fp8``: the weight
    gradient likewise (:func:`.fp8_backward.grouped_wgrad_fp8`)."""
    gemm, why = experts_gemm(spec, "real")
    if gemm != "real":
        raise ValueError(f"{FLAG} real: {why}")
    if grad_fp8:
        fp8_backward.check_fp8_backward(spec, "real", "experts")
    if wgrad_fp8:
        fp8_backward.check_fp8_wgrad(spec, "real", "experts")
    return GroupedRealFn.apply(x, qw, spec, [int(c) for c in counts], parallel_dim, group,
                               grad_fp8, wgrad_fp8, *masters)


def stacked_weight_operand(spec: QuantSpec, weights: list[torch.Tensor] | torch.Tensor,
                           parallel_dim: int, group, name: str,
                           finite: FiniteChecks | None = None) -> RealWeight:
    """:func:`weight_operand` of every expert, stacked ``[E, N, K]`` / ``[E, N, 1]`` (one
    quantizer call over the row stack without tensor parallelism: per-row scales).
    ``weights``: one weight per expert, or the stacked ``[E, N, K]`` weight itself, whose rows
    the quantizer then reads in place (no concatenated copy). ``finite``: as
    :func:`weight_operand`'s."""
    if not _split_dim(group, parallel_dim):
        e, (n, k) = len(weights), weights[0].shape
        rows = (weights.detach().reshape(e * n, k) if isinstance(weights, torch.Tensor)
                else torch.cat([w.detach() for w in weights]))
        q = weight_operand(spec, rows, name=name, finite=finite)
        return RealWeight(q.codes.view(e, n, k), q.scale.view(e, n, 1))
    qs = [weight_operand(spec, w, parallel_dim, group, name, finite=finite) for w in weights]
    return RealWeight(torch.stack([q.codes for q in qs]), torch.stack([q.scale for q in qs]))
