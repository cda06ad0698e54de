"""W8A8 per-output-channel formats: ``int8`` (SGLang ``w8a8_int8``) and ``fp8`` (``w8a8_fp8``).

Weights: one fp32 scale per output channel, ``weight_scale`` of shape [out, 1]; codes follow
ModelOpt's fake quantizer exactly (``tensor_quant._tensor_quant`` / ``_fp8_eager``):
``s = MAX / amax_row``, ``codes = cast(w * s)``, dequantize ``codes * (1 / s)``.
Activations: dynamic per token, as SGLang 0.5.17's kernels compute them:
``per_token_quant_int8`` (Triton): ``s_x = max(amax, 1e-10) / 127``,
``q = round_half_away(x * (127 / max(amax, 1e-10)))``; ``sgl_per_token_quant_fp8``:
``s_x = amax / 448``, ``q = e4m3(clamp(x * (1 / s_x)))`` (inverse 0 for an all-zero token).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..engine_facts import EngineFacts, KernelFlags, TERecipe
from ..into import row_chunks
from ..numerics import (
    FP8_E4M3_MAX,
    ZERO_AMAX_EPS,
    amax,
    cast_e4m3,
    constant,
    round_half_away,
)
from ..spec import QuantizedWeight, QuantSpec, register_spec
from ..spec_core import _lookup

_ACT_EPS = 1e-10


@dataclass(frozen=True)
class _PerChannelSpec(QuantSpec):
    granularity: str = "channel"
    activation: str = "per_token"
    bits_per_weight: float = 8.0
    fused_kernel: ClassVar[str | None] = "quantize_channel"
    fused_into_kernel: ClassVar[str | None] = "quantize_channel_into"
    fused_fake_kernel: ClassVar[str | None] = "fake_quant_channel"
    fused_act_kernel: ClassVar[str | None] = "quantize_act_per_token"
    fused_dequant_kernel: ClassVar[str | None] = "dequantize_rows"
    _max: ClassVar[float]

    def _codes(self, w32: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _row_scale(self, w32: torch.Tensor, a: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(quantize multiplier s = MAX/amax, zero-row mask) per output channel, [out, 1];
        ``a``: the fp32 row amaxes if already reduced."""
        a = amax(w32, dim=1) if a is None else a
        zero = a <= ZERO_AMAX_EPS
        return self._max / torch.where(zero, torch.ones_like(a), a), zero

    def _inv_scale(self, s: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """The packed ``weight_scale`` (``1 / s``) of multipliers ``s`` and zero-row mask."""
        return 1.0 / s

    def _codes_into(self, w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _scale_shape(self, out, k):
        return (out, 1)

    def _quantize_into(self, w, codes, scale):
        """Row amaxes (one read of ``w``, an exact inf-norm in its dtype), the scales as
        ``_quantize`` computes them, then the codes written into ``codes``
        (:meth:`_codes_into`)."""
        a = torch.linalg.vector_norm(w, float("inf"), dim=-1, keepdim=True).float()
        s, zero = self._row_scale(w, a)
        scale.copy_(self._inv_scale(s, zero))
        self._codes_into(w, s, codes)
        return a

    def _dequantize(self, q: QuantizedWeight) -> torch.Tensor:
        return q.codes.float() * q.scale

    def _act(self, x):
        """Per-token ``codes * scale`` (:meth:`_act_codes`, the format's kernel's numerics)."""
        codes, scale = self._act_codes(x)
        return codes.float() * scale

    def _packed_suffixes(self):
        return ("weight", "weight_scale")

    def _pack(self, module, q):
        return [(f"{module}.weight", q.codes), (f"{module}.weight_scale", q.scale)]

    def _unpack(self, module, tensors, dtype):
        codes = _lookup(tensors, f"{module}.weight")
        scale = _lookup(tensors, f"{module}.weight_scale").float().reshape(-1, 1)
        return QuantizedWeight(self.name, codes, scale, None, tuple(codes.shape), dtype)

    def hf_quantization_config(self):
        return {"quant_method": self.sglang_quantization}


@register_spec
@dataclass(frozen=True)
class Int8Spec(_PerChannelSpec):
    """INT8 symmetric per output channel (narrow range [-127, 127]); INT8 dynamic per token."""

    name: str = "int8"
    description: str = "W8A8 INT8: weights per output channel, activations dynamic per token"
    weight_format: str = "int8"
    sglang_quantization: str | None = "w8a8_int8"
    _max: ClassVar[float] = 127.0
    # w8a8_int8 replaces its parameters after loading: SGLang's load_weights ('tensor', 'disk')
    # fails ('Parameter' object has no attribute 'weight_loader'); expert adapters: Triton runner;
    # its live tensors are the packed ones (linear: weight.t(), MoE: as loaded): direct writes
    engine = EngineFacts(
        sglang_syncs={"tensor": False, "disk": False, "inplace": True, "distributed": True},
        te_recipe=None,
        moe_kernel=KernelFlags(use_int8_w8a8=True, per_channel_quant=True),
        lora_experts="adapter", direct_write=True)

    def _quantize(self, w, global_amax):
        w32 = w.float()
        s, zero = self._row_scale(w32)
        codes = torch.clamp(torch.round(w32 * s), -127, 127)
        codes = torch.where(zero, 0.0, codes).to(torch.int8)  # ModelOpt: amax ~0 -> codes 0
        scale = self._inv_scale(s, zero)
        return QuantizedWeight(self.name, codes, scale, None, tuple(w.shape), w.dtype)

    def _inv_scale(self, s, zero):
        return torch.where(zero, 1.0, 1.0 / s)

    def _codes_into(self, w, s, out):
        """``round(w * s)`` per fp32 chunk (:func:`~megatron_qrl.quant.into.row_chunks`),
        cast on the copy into ``out``: ``_quantize``'s codes, as ``_fake_quant``'s docstring
        shows (the clamp never binds, a zero row rounds to 0 anyway)."""
        for e, r in row_chunks(w.shape):
            t = torch.mul(w[e, r], s[e, r])
            out[e, r].copy_(t.round_())

    def _fake_quant(self, w, global_amax, name, finite=None):
        """``0 + round(w * s) * (1 / s)`` per row: three passes over the weight (multiply,
        round, multiply-add) after one for the row amaxes, no int8 codes.

        Bit-identical to ``_dequantize(_quantize(w))``: the int8 round trip of an integer is
        exact; the clamp never binds (``|w * s| <= 127 (1 + 2^-23)^2 < 127.5`` with
        ``s = fl(127 / amax)``); a zero row (amax <= 2^-24, ``s = 127``) rounds to +-0 anyway
        (``|w * 127| < 0.5``) and its scale is 1 on both paths; adding 0 turns the ``-0.0`` of
        ``round(-0.3)`` into the ``+0.0`` the int8 code 0 dequantizes to.
        """
        a = torch.linalg.vector_norm(w, float("inf"), dim=1, keepdim=True).float()
        self._check_finite_amax(a, w, name, finite)
        s, zero = self._row_scale(w, a)
        scale = torch.where(zero, 1.0, 1.0 / s)
        return torch.addcmul(constant((0.0,), w.device), torch.mul(w, s).round_(), scale)

    def _act_codes(self, x):
        a = torch.clamp(amax(x, dim=-1), min=_ACT_EPS)
        q = torch.clamp(round_half_away(x * (127.0 / a)), -128, 127)
        return q.to(torch.int8), a / 127.0

    def modelopt_config(self):
        import modelopt.torch.quantization as mtq

        cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
        _set_input_quantizer(cfg, {"num_bits": 8, "axis": None, "type": "dynamic",
                                   "block_sizes": {-1: None}})
        return cfg


@register_spec
@dataclass(frozen=True)
class FP8Spec(_PerChannelSpec):
    """FP8 E4M3 per output channel; FP8 E4M3 dynamic per token."""

    name: str = "fp8"
    description: str = "W8A8 FP8 E4M3: weights per output channel, activations dynamic per token"
    weight_format: str = "float8_e4m3fn"
    sglang_quantization: str | None = "w8a8_fp8"
    _max: ClassVar[float] = FP8_E4M3_MAX
    # w8a8_fp8: as int8 ('tensor' and 'disk' fail the same way); expert adapters: Triton runner
    engine = EngineFacts(
        sglang_syncs={"tensor": False, "disk": False, "inplace": True, "distributed": True},
        te_recipe=TERecipe(
            "fp8", "Float8CurrentScaling", {"fp8": "e4m3", "fp8_recipe": "tensorwise"}, (9, 10),
            False, "one scale per tensor; the rollout uses per-channel weight and per-token "
            "activation scales"),
        moe_kernel=KernelFlags(use_fp8_w8a8=True, per_channel_quant=True),
        lora_experts="adapter", direct_write=True)

    def _quantize(self, w, global_amax):
        s, _ = self._row_scale(w.float())
        codes = cast_e4m3(w.float() * s)
        return QuantizedWeight(self.name, codes, 1.0 / s, None, tuple(w.shape), w.dtype)

    def _codes_into(self, w, s, out):
        """``e4m3(w * s)`` in one kernel: the fp32 product (``w * s`` promotes) cast to E4M3
        as it is stored into ``out``. ``cast_e4m3``'s clamp never binds: ``|w| <= amax`` and
        ``s = fl(448 / amax)`` give ``|fl(w s)| <= 448 (1 + 2^-23)^2``, which rounds to 448
        (the next E4M3 step, 480, is past the format's max), so the unclamped cast is the same
        code."""
        torch.mul(w, s, out=out)

    def _fake_quant(self, w, global_amax, name, finite=None):
        """``e4m3(w * s) * (1 / s)`` per row, the same ops as ``_dequantize(_quantize(w))``
        minus the passes around them: the row amax in one pass in ``w``'s dtype (an inf-norm,
        exact), the finite check on it, no ``w.float()`` copy (``w * s`` promotes to fp32)."""
        a = torch.linalg.vector_norm(w, float("inf"), dim=1, keepdim=True).float()
        self._check_finite_amax(a, w, name, finite)
        s, _ = self._row_scale(w, a)
        return cast_e4m3(torch.mul(w, s)).float().mul_(1.0 / s)

    def _act_codes(self, x):
        # sgl_per_token_quant_fp8: no eps floor; an all-zero token gets inverse scale 0
        s = amax(x, dim=-1) / FP8_E4M3_MAX
        inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / torch.where(s == 0, 1.0, s))
        return cast_e4m3(x * inv), s

    def modelopt_config(self):
        import modelopt.torch.quantization as mtq

        return copy.deepcopy(mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG)


def _set_input_quantizer(cfg: dict, qcfg: dict) -> None:
    """Replace the ``*input_quantizer`` entry of a ModelOpt 0.47 list-style config."""
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*input_quantizer":
            entry["cfg"] = qcfg
            entry.pop("enable", None)
            return
    raise ValueError("ModelOpt config has no '*input_quantizer' entry to replace")
