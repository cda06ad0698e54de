"""``w4a16``: INT4 symmetric weights in groups of 128 along the input dim, BF16 activations.

Loaded by SGLang as compressed-tensors ``pack-quantized`` (Marlin W4A16 kernels): per linear
``weight_packed`` int32 [out, in/8] (eight int4 values per word, offset +8, lowest nibble
first), ``weight_scale`` bf16 [out, in/128] and ``weight_shape`` int64 [2].

Numerics: ModelOpt's INT4 blockwise rule (``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``:
``scale = amax_group / 7``, codes in [-7, 7]) with ONE deliberate difference: the scale is
stored in bf16, because that is what the Marlin kernel multiplies by, so the codes are
rounded against the bf16 scale: ``s = bf16(amax_g / 7)``, ``q = clamp(round(w / s), -8, 7)``,
``w_hat = q * s``. (compressed-tensors' own minmax observer uses ``amax / 7.5``; both produce
valid pack-quantized checkpoints — we keep ModelOpt's so AWQ/PTQ exports agree.)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..engine_facts import EngineFacts
from ..numerics import (
    ZERO_AMAX_EPS,
    amax,
    constant,
    pack_int4_to_int32,
    unpack_int32_to_int4,
)
from ..spec import QuantizedWeight, QuantSpec, register_spec
from ..spec_core import _lookup

GROUP = 128
SCALE_DTYPE = torch.bfloat16


def group_scale(a: torch.Tensor) -> torch.Tensor:
    """bf16 group scales ``s = bf16(amax_g / 7)`` from fp32 group amaxes; 1 where the amax is
    at most 2^-24 (ModelOpt's zero rule, :data:`ZERO_AMAX_EPS`)."""
    return torch.where(a <= ZERO_AMAX_EPS, torch.ones_like(a), a / 7.0).to(SCALE_DTYPE)


def _zero(device: torch.device) -> torch.Tensor:
    return constant((0.0,), device)


@register_spec
@dataclass(frozen=True)
class W4A16Spec(QuantSpec):
    """INT4 symmetric, group 128 along input, bf16 scales; activations unquantized."""

    name: str = "w4a16"
    description: str = "W4A16 INT4 symmetric, groups of 128 along input (compressed-tensors, Marlin)"
    weight_format: str = "int4"
    granularity: str = "group"
    block: tuple[int, int] | None = (1, GROUP)
    sglang_quantization: str | None = "compressed-tensors"
    bits_per_weight: float = 4.0 + 16.0 / GROUP
    fused_kernel: ClassVar[str | None] = "quantize_w4a16"
    fused_fake_kernel: ClassVar[str | None] = "fake_quant_w4a16"
    # compressed-tensors WNA16 MoE runs Marlin; expert adapters on Marlin with
    # moe_runner_backend=marlin
    engine = EngineFacts(
        sglang_syncs={"inplace": True},
        te_recipe=None,
        moe_kernel=None,
        lora_experts="adapter", lora_marlin=True,
        lora_moe_runner="marlin", direct_write=True)

    def _check_shape(self, shape, name):
        if shape[1] % GROUP:
            raise ValueError(
                f"w4a16: {name} has in_features={shape[1]}, not a multiple of the group size "
                f"{GROUP} (Marlin needs whole groups); keep this layer in bf16 or use int8/fp8"
            )

    def _quantize(self, w, global_amax):
        out, k = w.shape
        g = w.float().reshape(out, k // GROUP, GROUP)
        s = group_scale(amax(g, dim=-1))  # [out, k/G, 1]
        q = torch.clamp(torch.round(g / s.float()), -8, 7).to(torch.int8).reshape(out, k)
        return QuantizedWeight(self.name, q, s.squeeze(-1), None, (out, k), w.dtype)

    def _fake_quant(self, w, global_amax, name, finite=None):
        """``q * s`` with ``q = round(w / s)`` in fp32, no int8 codes: three passes over the
        weight (divide, round, multiply) after one for the group amaxes.

        Bit-identical to ``_dequantize(_quantize(w))``: the int8 round trip of an integer in
        [-8, 7] is exact, and the clamp never binds: ``s = bf16(amax_g / 7)`` is at least
        ``(amax_g / 7)(1 - 2^-8)``, so ``|w / s| <= 7.03 < 7.5`` (and ``|w| <= 2^-24`` with
        ``s = 1`` in a zero group). The one difference the codes make is the sign of zero:
        ``round(-0.3) = -0.0`` becomes int8 ``0``, i.e. ``+0.0``; ``0 + q * s`` (``addcmul``)
        gives that ``+0.0`` in the multiply's pass (``-0.0 + 0.0 = +0.0`` under
        round-to-nearest; the sum is exact for every other value).
        """
        out, k = w.shape
        g = w.reshape(out, k // GROUP, GROUP)
        a = torch.linalg.vector_norm(g, float("inf"), dim=-1, keepdim=True).float()
        self._check_finite_amax(a, w, name, finite)
        s = group_scale(a).float()
        q = torch.div(g, s).round_()
        return torch.addcmul(_zero(w.device), q, s).reshape(out, k)

    def _dequantize(self, q):
        out, k = q.shape
        g = q.codes.float().reshape(out, k // GROUP, GROUP)
        return (g * q.scale.float().unsqueeze(-1)).reshape(out, k)

    def _packed_suffixes(self):
        return ("weight_packed", "weight_scale", "weight_shape")

    def _pack(self, module, q):
        return self._pack_rows([module], q, [q.shape[0]])[0]

    def _pack_rows(self, modules, q, rows):
        """Row-local: eight codes per int32 along the input, one group-scale row per weight
        row; each weight's own ``[out, in]``. The words a fused quantizer wrote are taken as is."""
        shapes = torch.tensor([[r, q.shape[1]] for r in rows], dtype=torch.int64)
        words = pack_int4_to_int32(q.codes) if q.packed is None else q.packed
        return [[(f"{m}.weight_packed", p), (f"{m}.weight_scale", s), (f"{m}.weight_shape", sh)]
                for m, p, s, sh in zip(modules, words.split(rows),
                                       q.scale.split(rows), shapes.unbind(0))]

    def _unpack(self, module, tensors, dtype):
        shape = tuple(int(v) for v in _lookup(tensors, f"{module}.weight_shape"))
        codes = unpack_int32_to_int4(_lookup(tensors, f"{module}.weight_packed"))
        codes = codes[:, : shape[1]]
        scale = _lookup(tensors, f"{module}.weight_scale")
        return QuantizedWeight(self.name, codes, scale, None, shape, dtype)

    def hf_quantization_config(self):
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": GROUP,
                        "dynamic": False,
                        "actorder": None,
                        "observer": "minmax",
                    },
                    "input_activations": None,
                    "output_activations": None,
                    "format": "pack-quantized",
                }
            },
            # matched with re.match (anchored at the start) by SGLang's should_ignore_layer
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"],
            "kv_cache_scheme": None,
            "sparsity_config": {},
        }

    def modelopt_config(self):
        import modelopt.torch.quantization as mtq

        return copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
