"""``fp8_block``: FP8 E4M3 weights in 128x128 blocks, activations in dynamic 1x128 groups.

The DeepSeek-V3 layout SGLang loads with ``quant_method: fp8`` and
``weight_block_size: [128, 128]``: ``weight`` float8_e4m3fn [out, in] and
``weight_scale_inv`` fp32 [ceil(out/128), ceil(in/128)] — despite its name, the multiplier
applied at dequantization (``w = codes * weight_scale_inv``). Per block, codes follow
ModelOpt's FP8 fake quantizer (``_fp8_eager``): ``s = 448 / amax_block``,
``codes = e4m3(w * s)``, ``weight_scale_inv = 1 / s``. Activations follow SGLang's
``per_token_group_quant_fp8``: ``a = max(amax_group, 1e-10)``,
``x_q = e4m3(clamp(x * (448 / a)))``, dequantization scale ``a * (1 / 448)``. SGLang 0.5.17's
CUDA kernel is built with ``--use_fast_math``: its ``448 / a`` is the approximate division
(at most 2 ulp off), so a code whose ``x * 448 / a`` sits at an E4M3 rounding midpoint can
land one step away from this quantizer's (scales bit-equal); the real GEMM
(``te_quant.block_gemm``) multiplies SGLang's own codes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..engine_facts import EngineFacts, KernelFlags, TERecipe
from ..numerics import FP8_E4M3_MAX, ZERO_AMAX_EPS, amax, cast_e4m3, from_blocks_2d, to_blocks_2d
from ..spec import QuantizedWeight, QuantSpec, register_spec
from ..spec_core import _lookup

BLOCK = 128
_ACT_EPS = 1e-10


@register_spec
@dataclass(frozen=True)
class FP8BlockSpec(QuantSpec):
    """FP8 E4M3 with one scale per 128x128 weight block and per 1x128 activation group."""

    name: str = "fp8_block"
    description: str = "FP8 E4M3, 128x128 weight blocks (weight_scale_inv), activations 1x128 groups"
    weight_format: str = "float8_e4m3fn"
    granularity: str = "block"
    block: tuple[int, int] | None = (BLOCK, BLOCK)
    activation: str = "per_token_group"
    act_group: int | None = BLOCK
    sglang_quantization: str | None = "fp8"
    bits_per_weight: float = 8.0 + 32.0 / (BLOCK * BLOCK)
    fused_kernel: ClassVar[str | None] = "quantize_fp8_block"
    fused_into_kernel: ClassVar[str | None] = "quantize_fp8_block_into"
    fused_fake_kernel: ClassVar[str | None] = "fake_quant_fp8_block"
    fused_group_act_kernel: ClassVar[str | None] = "quantize_act_per_token_group"
    fused_dequant_kernel: ClassVar[str | None] = "dequantize_rows"
    # 'tensor' killed the engine, 'disk' works; Fp8MoEMethod with weight_block_size [128, 128]
    # (Triton path, DeepGEMM off); expert adapters merged (DeepGEMM runner on Hopper, no LoRA)
    engine = EngineFacts(
        sglang_syncs={"tensor": False, "disk": True, "inplace": True},
        te_recipe=TERecipe(
            "fp8_block", "Float8BlockScaling", {"fp8": "e4m3", "fp8_recipe": "blockwise"}, (9,),
            False, "same 128x128 / 1x128 blocks, E4M3 max and rounding, but TE's fp32 scale "
            "differs from 448/amax in the last bits (16% of weight blocks, 60% of activation "
            "groups): 0.23% of weight and 0.10% of activation codes sit on a rounding tie and "
            "land one E4M3 step away (H200, TE 2.20.2, bench/te_block_codes.py)",
            {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}, within_rounding=True),
        moe_kernel=KernelFlags(use_fp8_w8a8=True, block_shape=(128, 128)),
        lora_experts="merge", direct_write=True)

    def _check_shape(self, shape, name):
        # SGLang quantizes activations in groups of 128 along the input dim, so the input
        # dim must be a multiple of 128; partial output blocks are allowed (DeepSeek layout).
        if shape[1] % BLOCK:
            raise ValueError(
                f"fp8_block: {name} has in_features={shape[1]}, not a multiple of {BLOCK} "
                "(SGLang's 1x128 activation groups need it); use fp8 (per channel) instead"
            )

    def _quantize(self, w, global_amax):
        blocks, shape = to_blocks_2d(w.float(), BLOCK, BLOCK)
        a = amax(blocks, dim=(1, 3))  # [nb, 1, kb, 1]
        s = _block_scale(a)
        codes = from_blocks_2d(cast_e4m3(blocks * s), shape)
        scale_inv = (1.0 / s)[:, 0, :, 0].contiguous()
        return QuantizedWeight(self.name, codes, scale_inv, None, shape, w.dtype)

    def _dequantize(self, q):
        blocks, shape = to_blocks_2d(q.codes.float(), BLOCK, BLOCK)
        return from_blocks_2d(blocks * q.scale[:, None, :, None], shape)

    def _fake_quant(self, w, global_amax, name, finite=None):
        """``e4m3(w * s) * (1 / s)`` per 128x128 block, the same ops as
        ``_dequantize(_quantize(w))`` minus the passes around them: one zero-pad (none for
        whole blocks) instead of two, the block amax in one pass in ``w``'s dtype (an
        inf-norm, exact), the finite check on it, no ``w.float()`` copy."""
        blocks, shape = to_blocks_2d(w, BLOCK, BLOCK)
        a = torch.linalg.vector_norm(blocks, float("inf"), dim=(1, 3), keepdim=True).float()
        self._check_finite_amax(a, w, name, finite)
        s = _block_scale(a)
        return from_blocks_2d(cast_e4m3(blocks * s).float().mul_(1.0 / s), shape)

    def _scale_shape(self, out, k):
        return (-(-out // BLOCK), -(-k // BLOCK))

    def _quantize_into(self, w, codes, scale):
        """Per expert, the whole 128-row blocks and the partial last block (zero padding
        never changes an amax, so a partial block's amax is its rows'): block amaxes (one read
        of ``w``, an exact inf-norm in its dtype), ``weight_scale_inv = 1 / s`` as
        ``_quantize`` computes it, then ``e4m3(w * s)`` in one kernel per part, the fp32
        product cast to E4M3 as it is stored into ``codes`` (viewed as blocks: a view of the
        region, any strides). The clamp never binds (FP8Spec's ``_codes_into``)."""
        e, n, k = w.shape
        kb, full = k // BLOCK, n // BLOCK * BLOCK
        parts = [(r0, r1) for r0, r1 in ((0, full), (full, n)) if r1 > r0]

        def blocks(t, r0, r1, out=False):  # [E, blocks, rows per block, kb, 128]
            rows = min(r1 - r0, BLOCK)
            shape = (e, (r1 - r0) // rows, rows, kb, BLOCK)
            return t[:, r0:r1].view(shape) if out else t[:, r0:r1].reshape(shape)

        a = torch.cat([torch.linalg.vector_norm(blocks(w, *p), float("inf"), dim=(2, 4))
                       for p in parts], dim=1).float()
        s = _block_scale(a)
        scale.copy_(1.0 / s)
        b0 = 0
        for r0, r1 in parts:
            part = blocks(w, r0, r1)
            sp = s[:, b0:b0 + part.shape[1], None, :, None]
            torch.mul(part, sp, out=blocks(codes, r0, r1, out=True))
            b0 += part.shape[1]
        return a

    def _packed_suffixes(self):
        return ("weight", "weight_scale_inv")

    def _pack(self, module, q):
        return [(f"{module}.weight", q.codes), (f"{module}.weight_scale_inv", q.scale)]

    def _unpack(self, module, tensors, dtype):
        codes = _lookup(tensors, f"{module}.weight")
        scale = _lookup(tensors, f"{module}.weight_scale_inv").float()
        return QuantizedWeight(self.name, codes, scale, None, tuple(codes.shape), dtype)

    def _act(self, x):
        if x.shape[-1] % BLOCK:
            raise ValueError(f"fp8_block: activation dim {x.shape[-1]} is not a multiple of 128")
        g = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
        a = torch.clamp(amax(g, dim=-1), min=_ACT_EPS)
        q = cast_e4m3(g * (FP8_E4M3_MAX / a)).float() * (a * (1.0 / FP8_E4M3_MAX))
        return q.reshape(x.shape)

    def hf_quantization_config(self):
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        }

    def modelopt_config(self):
        import modelopt.torch.quantization as mtq

        cfg = copy.deepcopy(mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*input_quantizer":
                entry.pop("enable", None)
                entry["cfg"] = {
                    "num_bits": (4, 3),
                    "block_sizes": {-1: BLOCK, "type": "dynamic"},
                }
        return cfg


def _block_scale(a: torch.Tensor) -> torch.Tensor:
    """The quantize multiplier ``s = 448 / amax`` of each block's fp32 amax (ModelOpt
    ``_fp8_eager``; an amax at or below ``ZERO_AMAX_EPS`` counts as 1)."""
    return FP8_E4M3_MAX / torch.where(a <= ZERO_AMAX_EPS, torch.ones_like(a), a)
