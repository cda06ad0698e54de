"""The per-weight half of a format: its fields, reference quantizer and packing.

:class:`SpecCore` holds what one weight needs (1. and 2. of :mod:`megatron_qrl.quant.spec`);
the stream packers (:mod:`.stacked`, :mod:`.pack_stream`) build on it, and
:class:`~megatron_qrl.quant.spec.QuantSpec` (the registered formats' base) adds the
whole-stream packing on top, so imports point one way: ``spec -> pack_stream -> stacked ->
spec_core``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..utils.finite import require_finite
from . import targets
from .finite_checks import FiniteChecks
from .fused import fused_kernel as select_fused_kernel
from .into import Region
from .into import quantize_into as _quantize_into_regions
from .weight import QuantizedWeight

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _StraightThrough(torch.autograd.Function):
    """Forward: a quantize-dequantize function; backward: identity (STE, Bengio et al. 2013)."""

    @staticmethod
    def forward(ctx, x, fn):  # noqa: D401
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass(frozen=True)
class SpecCore:
    """A quantization format's fields and its numerics of one weight: quantize, dequantize,
    fake-quantize, pack and unpack (the base of :class:`~megatron_qrl.quant.spec.QuantSpec`).

    Each format is a frozen dataclass subclass of ``QuantSpec`` that sets these fields'
    defaults and implements the hooks ``_quantize``, ``_dequantize``, ``_pack``, ``_unpack``,
    ``_packed_suffixes`` (and ``_act`` for W8A8 formats; ``_fake_quant`` where a direct
    computation of the dequantized weight saves passes over memory). The stream packers
    (:mod:`.stacked`, :mod:`.pack_stream`) build on this class alone.
    """

    name: str = ""
    """Registry key and ``--qrl-rollout-format`` value."""
    description: str = ""
    weight_format: str = "none"
    """``none`` | ``int8`` | ``float8_e4m3fn`` | ``int4`` | ``e2m1``."""
    granularity: str = "none"
    """``none`` | ``channel`` | ``block`` | ``group``: what one weight scale covers."""
    block: tuple[int, int] | None = None
    """(rows, cols) covered by one weight scale for block/group formats."""
    activation: str = "none"
    """``none`` | ``per_token`` | ``per_token_group``: dynamic activation quantization."""
    act_group: int | None = None
    sglang_quantization: str | None = None
    """SGLang ``--quantization`` method that loads the packed tensors."""
    shares_tensor_scale: bool = False
    """True if one per-tensor scale must be shared by a fused group (q/k/v, gate/up)."""
    bits_per_weight: float = 16.0
    fused_act_kernel: ClassVar[str | None] = None
    """The fused :meth:`quantize_activation`, a function of :mod:`.triton_act` (None: torch);
    chosen by :func:`.fused.fused_kernel` as the weight quantizer is."""
    fused_dequant_kernel: ClassVar[str | None] = None
    """The fused per-row ``(codes * scale).to(dtype)`` of :meth:`dequantize_rows` (None: torch)."""
    fused_group_act_kernel: ClassVar[str | None] = None
    """Per-token-group formats: the fused ``(codes [..., K], scales [..., K / act_group])`` of
    the activation quantizer, a function of :mod:`.triton_act` (None: torch), which the fake
    path's :meth:`fake_quant_activation` dequantizes through :meth:`dequantize_rows`."""
    fused_kernel: ClassVar[str | None] = None
    """The format's fused quantizer, a function of :mod:`.triton_quant` giving
    :meth:`_quantize`'s bits, or None; :meth:`quantize_weight` asks
    :func:`.fused.fused_kernel` whether it runs."""
    fused_into_kernel: ClassVar[str | None] = None
    """The fused :meth:`_quantize_into` (codes and scales of an expert stack written into
    strided regions), a function of :mod:`.triton_quant`, or None; :meth:`quantize_into` asks
    :func:`.fused.fused_kernel` whether it runs."""
    fused_fake_kernel: ClassVar[str | None] = None
    """The format's fused fake quantizer, a function of :mod:`.triton_fake` giving
    :meth:`quantize_dequantize`'s bits in one kernel (no fp32 temporaries), or None; chosen by
    :func:`.fused.fused_kernel` as the weight quantizer is."""

    # ---- public API -------------------------------------------------------------------
    @property
    def quantizes_weights(self) -> bool:
        return self.weight_format != "none"

    @property
    def quantizes_activations(self) -> bool:
        return self.activation != "none"

    def is_quantized(self, hf_name: str) -> bool:
        """True if this format stores ``hf_name`` in low precision on the rollout side."""
        return self.quantizes_weights and targets.is_quantized(hf_name)

    def quantize_weight(
        self,
        w: torch.Tensor,
        *,
        global_amax: torch.Tensor | float | None = None,
        name: str = "weight",
        finite: FiniteChecks | None = None,
    ) -> QuantizedWeight:
        """Quantize a [out, in] weight exactly as the rollout engine will hold it.

        ``global_amax`` overrides the per-tensor amax of two-level formats (NVFP4) so that the
        members of a fused group (q/k/v, gate/up) share one scale; ignored elsewhere. It may
        also be ``[out, 1]``, one per row: ``w`` is then a row-stack of weights, each row
        quantized with its weight's amax (:mod:`megatron_qrl.quant.stacked`), and the result's
        ``global_scale`` is ``[out, 1]``.

        A NaN / Inf in ``w`` raises :class:`~megatron_qrl.utils.finite.NonFiniteError` naming
        ``name`` (a host sync); with ``finite`` (a stream's, :mod:`.finite_checks`) it is
        recorded there instead, for one check at the stream's end.
        """
        kernel = (select_fused_kernel(self, w.device) if isinstance(w, torch.Tensor) and w.numel()
                  else None)  # an empty weight: the reference's own checks and result
        self._check_weight(w, name, finite=kernel is None and finite is None)
        ga = self._global_amax(w, global_amax, name)
        with torch.no_grad():
            if kernel is None:
                if finite is not None:
                    finite.add(name, torch.isfinite(w.detach()))
                return self._quantize(w.detach(), ga)
            q, tile_amax = kernel(self, w.detach(), *self._fused_args(w.detach(), ga))
        self._check_finite_amax(tile_amax, w, name, finite)
        return q

    def quantize_dequantize(
        self,
        w: torch.Tensor,
        *,
        global_amax: torch.Tensor | float | None = None,
        name: str = "weight",
        finite: FiniteChecks | None = None,
    ) -> torch.Tensor:
        """``dequantize(quantize_weight(w, global_amax=...))`` in ``w``'s dtype, bit for bit,
        without autograd, through the format's fused fake-quant kernel where
        :meth:`fused_fake` picks one (one read and one write of the weight), else its torch
        fast path (:meth:`_fake_quant`: the dequantized value computed directly, no integer
        codes, few elementwise passes).
        Same arguments and errors as :meth:`quantize_weight` (``finite`` included: the
        aligned forward's once-per-step refresh records its weights there)."""
        if not self.quantizes_weights:
            return w.detach()
        self._check_weight(w, name, finite=False)  # the format checks finiteness on its amax
        ga = self._global_amax(w, global_amax, name)
        kernel = self.fused_fake(w.device) if w.numel() else None
        with torch.no_grad():
            if kernel is None:
                return self._fake_quant(w.detach(), ga, name, finite).to(w.dtype)
            out, tile_amax = kernel(self, w.detach(), *self._fused_args(w.detach(), ga))
        self._check_finite_amax(tile_amax, w, name, finite)
        return out

    def fused_fake(self, device: torch.device):
        """The fused fake quantizer :meth:`quantize_dequantize` runs on ``device`` (a function
        of :mod:`.triton_fake`), or None: the torch ``_fake_quant`` (:func:`.fused.fused_kernel`
        decides, as for :meth:`quantize_weight`)."""
        return select_fused_kernel(self, device, "fused_fake_kernel")

    def dequantize(self, q: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the rollout engine computes with, in ``dtype`` (default: the original)."""
        if q.spec != self.name:
            raise ValueError(f"{self.name}.dequantize got a weight quantized with {q.spec!r}")
        with torch.no_grad():
            return self._dequantize(q).to(dtype or q.dtype)

    def fake_quant_weight(
        self, w: torch.Tensor, *, global_amax: torch.Tensor | float | None = None
    ) -> torch.Tensor:
        """``dequantize(quantize_weight(w))`` with a straight-through gradient into ``w``."""
        if not self.quantizes_weights:
            return w
        return _StraightThrough.apply(
            w, lambda x: self.quantize_dequantize(x, global_amax=global_amax)
        )

    def fake_quant_activation(self, x: torch.Tensor) -> torch.Tensor:
        """Dynamic activation quantization of W8A8 formats (STE); identity for weight-only."""
        if not self.quantizes_activations:
            return x
        return _StraightThrough.apply(x, self._fake_act)

    def _fake_act(self, t: torch.Tensor) -> torch.Tensor:
        """The activation's dequantized value in ``t``'s dtype. Per-token formats: codes and
        scales, then ``(codes * scale).to(dtype)``, the fused kernels where they are picked (two
        passes instead of ~10; per-token-group formats through ``fused_group_act_kernel`` alike);
        the same bits as ``_act(t.float()).to(dtype)``, the others'."""
        if self.fused_act_kernel is not None:
            return self.dequantize_rows(*self.quantize_activation(t), t.dtype)
        kernel = (select_fused_kernel(self, t.device, "fused_group_act_kernel")
                  if self.fused_group_act_kernel is not None and t.numel() else None)
        if kernel is not None:  # per-token groups: one scale per group, as rows of the group
            with torch.no_grad():
                codes, scale = kernel(self, t.detach())
            rows = codes.view(-1, self.act_group)
            return self.dequantize_rows(rows, scale.reshape(-1, 1), t.dtype).view(t.shape)
        return self._act(t.detach().float()).to(t.dtype)

    def quantize_activation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, scale)`` of the rollout's dynamic per-token activation quantization of ``x``
        (no autograd): ``codes`` in the weight's element type, ``scale`` fp32 ``[..., 1]``;
        ``codes.float() * scale`` is :meth:`fake_quant_activation`'s value, bit for bit. The
        operands of a real low-bit GEMM (W8A8 per-token formats only)."""
        if self.activation != "per_token":
            raise ValueError(f"{self.name}: quantize_activation needs per-token activation "
                             f"quantization (activation={self.activation!r})")
        kernel = select_fused_kernel(self, x.device, "fused_act_kernel") if x.numel() else None
        with torch.no_grad():
            if kernel is not None:  # reads x in its own dtype: no fp32 copy
                return kernel(self, x.detach())
            return self._act_codes(x.detach().float())

    def dequantize_rows(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                        ) -> torch.Tensor:
        """``(codes.float() * scale).to(dtype)`` for codes ``[..., K]`` with one fp32 scale per
        row ``[..., 1]`` (per-channel weight codes, per-token activation codes): the operands
        the straight-through backward multiplies, bit for bit the same from either
        implementation (the fused kernel where :func:`.fused.fused_kernel` picks it)."""
        kernel = (select_fused_kernel(self, codes.device, "fused_dequant_kernel")
                  if codes.numel() else None)
        with torch.no_grad():
            if kernel is not None:
                return kernel(self, codes, scale, dtype)
            return (codes.float() * scale).to(dtype)

    def pack(
        self, hf_name: str, w: torch.Tensor, *, global_amax: torch.Tensor | float | None = None,
        finite: FiniteChecks | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors SGLang's loader expects for HF tensor ``hf_name`` (names, dtypes, layout).

        Tensors this format leaves in high precision come back unchanged. ``finite``: as
        :meth:`quantize_weight`'s.
        """
        if not self.is_quantized(hf_name):
            return [(hf_name, w)]
        return self.pack_quantized(hf_name, self.quantize_weight(w, global_amax=global_amax,
                                                                 name=hf_name, finite=finite))

    def quantize_into(self, hf_name: str, w: torch.Tensor, region: Region,
                      finite: FiniteChecks | None = None) -> list[tuple[str, torch.Tensor]]:
        """:meth:`pack`'s codes and scales of weight ``hf_name`` (``[out, in]``, or an expert
        stack ``[E, out, in]`` under its stacked name) written straight into the tensors
        ``region(packed_name, shape, dtype)`` gives (views of an engine's storage, any
        strides), bit for bit, without a packed copy (:mod:`.into`); returns ``(packed name,
        tensor written)``. ``finite``: where the weight's finiteness goes (checked once at the
        end of the stream, :meth:`.finite_checks.FiniteChecks.check`) instead of a host sync
        now. Formats without ``_quantize_into`` raise NotImplementedError."""
        return _quantize_into_regions(self, hf_name, w, region, finite)

    def pack_quantized(self, hf_name: str, q: QuantizedWeight) -> list[tuple[str, torch.Tensor]]:
        """The tensors :meth:`pack` emits for quantized weight ``hf_name`` from ``q``, its
        :meth:`quantize_weight` (or its split of a stacked one, :mod:`.stacked`)."""
        return self._pack(targets.module_name(hf_name), q)

    def pack_stacked(self, hf_names: Sequence[str], q: QuantizedWeight, rows: Sequence[int]
                     ) -> list[list[tuple[str, torch.Tensor]]] | None:
        """:meth:`pack_quantized` of each weight of a stacked quantization, in one go: ``q``
        quantizes the row-concatenation of weights ``hf_names`` of ``rows[i]`` rows each
        (:func:`.stacked.quantize_stacks`); each weight's tensors are views of the stack's
        packed tensors (a few kernels for the stack, not a few per weight). None where the
        format packs one weight at a time (then split ``q``: :func:`.stacked.split_stack`)."""
        return self._pack_rows([targets.module_name(n) for n in hf_names], q, list(rows))

    def unpack(
        self,
        hf_name: str,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.bfloat16,
    ) -> QuantizedWeight | torch.Tensor:
        """Inverse of :meth:`pack` (reads only this module's tensors from ``tensors``).

        Returns a :class:`QuantizedWeight` for quantized weights, else the stored tensor.
        """
        if not self.is_quantized(hf_name):
            return _lookup(tensors, hf_name)
        return self._unpack(targets.module_name(hf_name), tensors, dtype)

    def packed_names(self, hf_name: str) -> tuple[str, ...]:
        """Names :meth:`pack` emits for ``hf_name`` (cheap, no quantization)."""
        if not self.is_quantized(hf_name):
            return (hf_name,)
        mod = targets.module_name(hf_name)
        return tuple(f"{mod}.{suffix}" for suffix in self._packed_suffixes())

    def shared_amax(self, hf_name: str, tensors: Mapping[str, torch.Tensor]) -> float | None:
        """The amax ``hf_name`` must be quantized with: the max over its fused group's members
        in ``tensors`` (None for formats or weights without a shared per-tensor scale)."""
        group = self.fusion_group(hf_name)
        if group is None:
            return None
        return max(float(_amax_all(tensors[m])) for m in group[1])

    def fusion_group(self, hf_name: str) -> tuple[str, tuple[str, ...]] | None:
        """Fused group whose members must share a per-tensor scale (None if not needed)."""
        if not (self.shares_tensor_scale and self.is_quantized(hf_name)):
            return None
        return targets.fusion_group(hf_name)

    def hf_quantization_config(self) -> dict[str, Any] | None:
        """The ``quantization_config`` block of config.json SGLang reads (None for bf16)."""
        raise NotImplementedError

    def modelopt_config(self) -> dict[str, Any]:
        """A ModelOpt ``mtq.quantize`` config with the same numerics (see each format)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"QuantSpec({self.name!r}: {self.description})"

    # ---- hooks ---------------------------------------------------------------------------
    def _quantize(self, w: torch.Tensor, global_amax: torch.Tensor | None) -> QuantizedWeight:
        raise NotImplementedError

    def _dequantize(self, q: QuantizedWeight) -> torch.Tensor:
        raise NotImplementedError

    def _fused_args(self, w: torch.Tensor, global_amax: torch.Tensor | None) -> tuple:
        """Arguments of the fused quantizer after ``(spec, w)`` (nvfp4: its tensor scale)."""
        return ()

    def _fake_quant(self, w: torch.Tensor, global_amax: torch.Tensor | None, name: str,
                    finite: FiniteChecks | None = None) -> torch.Tensor:
        """``_dequantize(_quantize(w))`` (any float dtype; the caller casts to ``w``'s).

        Formats override it with a direct computation of the same bits (no codes); an
        override must check finiteness itself (:meth:`_check_finite_amax` on an amax it
        reduces anyway; ``finite`` as :meth:`quantize_weight`'s). ``w`` has passed
        :meth:`_check_weight` without the finite check.
        """
        self._check_finite_amax(w, w, name, finite)  # (w bounds its own amax)
        return self._dequantize(self._quantize(w, global_amax))

    def _pack(self, module: str, q: QuantizedWeight) -> list[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def _quantize_into(self, w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
                       ) -> torch.Tensor:
        """Write ``_quantize``'s codes and scales of the expert stack ``w`` ``[E, out, in]``
        into ``codes`` ``[E, out, in]`` and ``scale`` ``[E, *_scale_shape(out, in)]``;
        returns the amaxes it reduced over all of ``w`` (NaN and Inf propagate: the caller's
        finiteness check, :meth:`quantize_into`)."""
        raise self._no_into()

    def _scale_shape(self, out: int, k: int) -> tuple[int, ...]:
        """Shape of the packed scale tensor of an ``[out, k]`` weight (:meth:`quantize_into`)."""
        raise self._no_into()

    def _no_into(self) -> NotImplementedError:
        return NotImplementedError(
            f"{self.name}: quantizing straight into an engine's tensors is not implemented "
            "for this format (its engine layout is not its packed one)")

    def _pack_rows(self, modules: list[str], q: QuantizedWeight, rows: list[int]
                   ) -> list[list[tuple[str, torch.Tensor]]] | None:
        """:meth:`_pack` of each weight of a stack in one go (formats whose packing is
        row-local and costs kernels), or None (:meth:`pack_stacked`)."""
        return None

    def _unpack(
        self, module: str, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> QuantizedWeight:
        raise NotImplementedError

    def _packed_suffixes(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _act_codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _check_shape(self, shape: tuple[int, int], name: str) -> None:
        """Formats with block/group constraints raise here (clear error naming the tensor)."""

    # ---- shared validation -----------------------------------------------------------
    def _check_weight(self, w: torch.Tensor, name: str, finite: bool = True) -> None:
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{self.name}: {name} must be a 2-D [out, in] tensor, got {shape}")
        if w.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{self.name}: {name} has dtype {w.dtype}; expected fp32/bf16/fp16")
        if finite:
            self._check_finite(w, name)
        self._check_shape(tuple(w.shape), name)

    def _check_finite(self, w: torch.Tensor, name: str) -> None:
        require_finite(w, f"{self.name}: {name}", "the checkpoint or the last optimizer step is broken")

    def _check_finite_amax(self, a: torch.Tensor, w: torch.Tensor, name: str,
                           finite: FiniteChecks | None = None) -> None:
        """The finite check of :meth:`_check_weight` from an amax ``a`` reduced over all of
        ``w`` (a max propagates NaN and Inf: ATen ``SharedReduceOps.h`` ``AbsMaxOps``, the
        inf-norm's reduction, uses ``max_propagate_nan`` on CUDA and ``max_impl`` on CPU): one
        small kernel instead of ``isfinite`` (four full passes: ``==``, ``abs``, ``!=``, ``*``)
        and ``all``. Without ``finite`` it reads the result on the host now (one device->host
        sync, which drains a GPU's queue: right for one weight); a stream passes its
        :class:`~.finite_checks.FiniteChecks` (``a``'s first dimension along ``w``'s rows or
        block rows) and checks all its weights at its end with one sync."""
        if finite is not None:
            finite.add(name, torch.isfinite(a))
        elif not bool(torch.isfinite(a).all()):
            self._check_finite(w, name)

    def _global_amax(self, w: torch.Tensor, global_amax: torch.Tensor | float | None,
                     name: str) -> torch.Tensor | None:
        """``global_amax`` as fp32 on ``w``'s device: a scalar, or ``[out, 1]`` (checked)."""
        if global_amax is None:
            return None
        if isinstance(global_amax, torch.Tensor):
            global_amax = global_amax.detach()
        ga = torch.as_tensor(global_amax, dtype=torch.float32, device=w.device)
        if ga.dim() == 2 and tuple(ga.shape) != (w.shape[0], 1):
            raise ValueError(f"{self.name}: per-row global_amax for {name} must have shape "
                             f"[{w.shape[0]}, 1], got {tuple(ga.shape)}")
        return ga if ga.dim() == 2 else ga.reshape(())


def row_starts(rows: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``int64`` index of each weight's first row in a row-concatenation of ``rows``."""
    return torch.tensor([0, *rows[:-1]], dtype=torch.int64).cumsum(0).to(device)


def _amax_all(w: torch.Tensor) -> torch.Tensor:
    return w.detach().float().abs().amax()


def _lookup(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise KeyError(f"packed tensor {key!r} is missing (have {len(tensors)} tensors)") from None
