"""The result of quantizing one weight (shared by the spec, its formats and the stacked path)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """The exact result of quantizing one [out, in] weight.

    ``codes`` are unpacked (one element per weight: int8 values, int4 values in int8,
    float8_e4m3fn values, or E2M1 4-bit codes in uint8); ``scale`` is the dequantization
    multiplier in the format's own layout (per channel ``[out, 1]``, per 128x128 block
    ``[ceil(out/128), ceil(in/128)]``, per group ``[out, in/g]``); ``global_scale`` is the fp32
    per-tensor scale of two-level formats (NVFP4), else None. ``packed`` is, where a fused
    quantizer (:mod:`.fused`) wrote it beside the codes, the codes in the engine's packed
    layout (w4a16's int32 words, nvfp4's nibble bytes): ``_pack`` then takes it as is.
    """

    spec: str
    codes: torch.Tensor
    scale: torch.Tensor | None
    global_scale: torch.Tensor | None
    shape: tuple[int, int]
    dtype: torch.dtype
    packed: torch.Tensor | None = None
