"""``nvfp4``: E2M1 weights in blocks of 16, FP8-E4M3 block scales, one FP32 tensor scale.

QeRL (seed 002), NVFP4 as in docs/ALGORITHMS.md section 3: ``W_hat = s_fp32 * (s_e4m3 * W_q)``.
Numerics are ModelOpt's ``NVFP4QTensor.quantize`` given our tensor scale:
``s_fp32 = bf16_ceil(amax(W) / (6 * 448))``; per block ``s_blk = e4m3(clamp(amax_blk / (6 s_fp32),
2^-9, 448))`` (0 -> 1); ``W_q = e2m1(W / (s_blk * s_fp32))`` (nearest, ties to even,
saturating at 6). Packed for SGLang ``modelopt_fp4``: ``weight`` uint8 [out, in/2] (element
2i in the low nibble), ``weight_scale`` float8_e4m3fn [out, in/16], ``weight_scale_2`` fp32
scalar and ``input_scale`` fp32 scalar (1.0: the rollout is weight-only W4A16 on Hopper).

One deliberate difference from ModelOpt's default: SGLang's Marlin FP4 path (Hopper) casts
``weight_scale_2`` to bf16 and dequantizes ``e2m1 * e4m3 * bf16(s_fp32)`` in bf16. We round
the tensor scale UP to the nearest bf16 value (no block scale can then exceed 448), so the
engine's bf16 copy equals ours exactly and the product is rounded once on both sides.

q/k/v and gate/up must share ``s_fp32`` (SGLang fuses them and keeps one scale): use
:meth:`QuantSpec.pack_state_dict` or pass ``global_amax`` of the fused group.

Every block depends on its row's ``s_fp32`` only, so a row-stack of many weights quantizes in
one pass when ``s_fp32`` is given per row (:func:`quantize_rows`; ``global_amax`` of shape
``[out, 1]`` in :meth:`QuantSpec.quantize_weight`, used by :mod:`megatron_qrl.quant.stacked`):
one implementation of the maths for one weight and for a stack.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..engine_facts import EngineFacts, TERecipe
from ..numerics import (
    E2M1_MAX,
    FP8_E4M3_MAX,
    amax,
    bf16_ceil,
    e2m1_decode,
    e2m1_encode,
    e2m1_round,
    pack_nibbles,
    unpack_nibbles,
)
from ..spec import QuantizedWeight, QuantSpec, register_spec
from ..spec_core import _lookup, row_starts

BLOCK = 16
_E4M3_MIN_SUBNORMAL = 2.0**-9


@register_spec
@dataclass(frozen=True)
class NVFP4Spec(QuantSpec):
    """NVFP4 weights (W4A16 on Hopper; W4A4 only on Blackwell, not enabled here)."""

    name: str = "nvfp4"
    description: str = "NVFP4: E2M1 blocks of 16, E4M3 block scales, FP32 tensor scale (W4A16)"
    weight_format: str = "e2m1"
    granularity: str = "block"
    block: tuple[int, int] | None = (1, BLOCK)
    sglang_quantization: str | None = "modelopt_fp4"
    shares_tensor_scale: bool = True
    bits_per_weight: float = 4.0 + 8.0 / BLOCK
    fused_kernel: ClassVar[str | None] = "quantize_nvfp4"
    fused_fake_kernel: ClassVar[str | None] = "fake_quant_nvfp4"
    # ModelOpt NVFP4 MoE: Marlin on sm90 (adapters served), FlashInfer TRT-LLM on sm100+ (merged)
    engine = EngineFacts(
        sglang_syncs={"inplace": True},
        te_recipe=TERecipe(
            "nvfp4", "NVFP4BlockScaling", {"fp4": "nvfp4", "fp4_recipe": "nvfp4"}, (10,), False,
            "W4A4 (activations quantized too); the rollout's nvfp4 is W4A16"),
        moe_kernel=None,
        lora_experts="adapter", lora_marlin=True,
        lora_merge_from=(10, 0))

    def _check_shape(self, shape, name):
        if shape[1] % BLOCK:
            raise ValueError(
                f"nvfp4: {name} has in_features={shape[1]}, not a multiple of {BLOCK}"
            )

    def _quantize(self, w, global_amax):
        w32 = w.float()
        ga = amax(w32, dim=(0, 1), keepdim=False) if global_amax is None else global_amax
        s2 = tensor_scale(ga)
        codes, s_blk = quantize_rows(w32, s2)
        return QuantizedWeight(self.name, codes, s_blk, s2, tuple(w.shape), w.dtype)

    def _dequantize(self, q):
        return dequantize_rows(q.codes, q.scale, q.global_scale)

    def _fused_args(self, w, global_amax):
        """The tensor scale of :meth:`_quantize` (the fused kernel's ``s2``)."""
        ga = (torch.linalg.vector_norm(w, float("inf")).float() if global_amax is None
              else global_amax)
        return (tensor_scale(ga),)

    def _fake_quant(self, w, global_amax, name, finite=None):
        """``dequantize_rows(*quantize_rows(w))`` without codes (:func:`fake_quant_rows`); the
        block amaxes give the tensor amax (a max of maxes) and the finite check."""
        a_blk = block_amax(w)
        self._check_finite_amax(a_blk, w, name, finite)
        ga = a_blk.amax() if global_amax is None else global_amax
        return fake_quant_rows(w, tensor_scale(ga), a_blk)

    def _packed_suffixes(self):
        return ("weight", "weight_scale", "weight_scale_2", "input_scale")

    def _pack(self, module, q):
        return self._pack_rows([module], q, [q.shape[0]])[0]

    def _pack_rows(self, modules, q, rows):
        """Row-local: nibbles along the input, one block-scale row per weight row; each
        weight's tensor scale (a scalar alone, the value of its rows in a stack) and a unit
        input scale. The bytes a fused quantizer wrote are taken as is."""
        g = q.global_scale
        tensor_scales = g[row_starts(rows, g.device), 0] if g.dim() == 2 else g.reshape(1)
        nibbles = pack_nibbles(q.codes) if q.packed is None else q.packed
        return [[(f"{m}.weight", c), (f"{m}.weight_scale", s), (f"{m}.weight_scale_2", s2),
                 (f"{m}.input_scale", one)]
                for m, c, s, s2, one in zip(modules, nibbles.split(rows),
                                            q.scale.split(rows), tensor_scales.unbind(0),
                                            torch.ones(len(rows), dtype=torch.float32).unbind(0))]

    def _unpack(self, module, tensors, dtype):
        codes = unpack_nibbles(_lookup(tensors, f"{module}.weight"))
        scale = _lookup(tensors, f"{module}.weight_scale")
        s2 = _lookup(tensors, f"{module}.weight_scale_2").float().reshape(())
        return QuantizedWeight(self.name, codes, scale, s2, tuple(codes.shape), dtype)

    def hf_quantization_config(self):
        # SGLang ModelOptFp4Config.from_config, flat config.json form; ``ignore`` globs are
        # matched against the full module path or any dotted part (lm_head is quantized
        # unless excluded).
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": BLOCK,
            "ignore": ["lm_head", "*.mlp.gate", "*.shared_expert_gate", "*embed_tokens"],
            "kv_cache_scheme": None,
        }

    def modelopt_config(self):
        import modelopt.torch.quantization as mtq

        return copy.deepcopy(mtq.W4A16_NVFP4_CFG)


def tensor_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``s_fp32 = bf16_ceil(amax / (6 * 448))`` elementwise (a scalar, or one per row), and 1
    where the amax is 0 (an all-zero weight: any positive scale gives all-zero codes). No host
    sync: ``torch.where``, not ``if``."""
    s2 = bf16_ceil(global_amax.float() / (E2M1_MAX * FP8_E4M3_MAX))
    return torch.where(s2 == 0, torch.ones_like(s2), s2)


def _per_row(s2: torch.Tensor) -> torch.Tensor:
    """A scalar tensor scale as is; a per-row ``[out, 1]`` one as ``[out, 1, 1]`` (blocks)."""
    return s2 if s2.dim() == 0 else s2.reshape(-1, 1, 1)


def quantize_rows(w32: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes ``[out, in]`` and E4M3 block scales ``[out, in/16]`` of fp32 ``w32`` given
    the tensor scale ``s2`` (a scalar, or ``[out, 1]``: one per row of a row-stack).

    QeRL (seed 002) / docs/ALGORITHMS.md sec. 3, ModelOpt ``NVFP4QTensor.quantize``:
    ``s_blk = e4m3(clamp(amax_blk / (6 s2), 2^-9, 448))`` (0 -> 1),
    ``W_q = e2m1(W / (s_blk * s2))``.
    """
    out, k = w32.shape
    s2b = _per_row(s2)
    blocks = w32.reshape(out, k // BLOCK, BLOCK)
    s_blk = block_scales(amax(blocks, dim=-1), s2b)
    scaled = blocks / (s_blk.float() * s2b)
    return e2m1_encode(scaled).reshape(out, k), s_blk.squeeze(-1)


def block_amax(w: torch.Tensor) -> torch.Tensor:
    """``[out, in/16, 1]`` fp32 ``max |W|`` per block of 16, in ONE pass over ``w`` in its own
    dtype (an inf-norm; a max is exact in any dtype, so it equals ``amax(w.float())``)."""
    out, k = w.shape
    blocks = w.reshape(out, k // BLOCK, BLOCK)
    return torch.linalg.vector_norm(blocks, float("inf"), dim=-1, keepdim=True).float()


def block_scales(a_blk: torch.Tensor, s2b: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales ``s_blk = e4m3(clamp(amax_blk / (6 s2), 2^-9, 448))``, 0 -> 1
    (QeRL seed 002 / docs/ALGORITHMS.md sec. 3; ModelOpt ``NVFP4QTensor.get_weights_scaling_factor``)."""
    s_blk = a_blk / (E2M1_MAX * s2b)
    s_blk = torch.where(s_blk == 0, torch.ones_like(s_blk), s_blk)
    return s_blk.clamp(_E4M3_MIN_SUBNORMAL, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def fake_quant_rows(w: torch.Tensor, s2: torch.Tensor, a_blk: torch.Tensor) -> torch.Tensor:
    """``dequantize_rows(*quantize_rows(w.float(), s2), s2)`` bit for bit, fp32, without codes.

    docs/ALGORITHMS.md sec. 3, ``W_hat = s2 * (s_e4m3 * e2m1(W / (s_e4m3 * s2)))`` in four passes
    over the weight: ``x = W / d`` with ``d = s_e4m3 * s2`` (the same fp32 product both
    :func:`quantize_rows` divides by and :func:`dequantize_rows` multiplies by), the E2M1 value
    of ``x`` by threshold search and table (:func:`e2m1_round`, two passes), ``* d``.
    ``w`` may stay bf16 (``W / d`` promotes to fp32 exactly); ``a_blk`` is :func:`block_amax`.
    """
    out, k = w.shape
    s2b = _per_row(s2)
    d = block_scales(a_blk, s2b).float() * s2b
    vals = e2m1_round(w.reshape(out, k // BLOCK, BLOCK) / d)
    return vals.mul_(d).reshape(out, k)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """``W_hat = s2 * (s_e4m3 * e2m1)`` in fp32 (docs/ALGORITHMS.md sec. 3); ``s2`` a scalar or
    ``[out, 1]`` (a row-stack)."""
    out, k = codes.shape
    vals = e2m1_decode(codes).reshape(out, k // BLOCK, BLOCK)
    per_block = scale.float() * s2
    return (vals * per_block.unsqueeze(-1)).reshape(out, k)
