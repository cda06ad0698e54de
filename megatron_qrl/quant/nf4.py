"""NF4 with double quantization (QLoRA, Dettmers et al. 2023), pure torch.

A trainer-storage format for the frozen base of QLoRA (``--qrl-lora-base-format nf4``): SGLang
0.5.17 has no NF4 packing our sync could target, so it is not a rollout ``QuantSpec``; the
engine receives the dequantized base (see docs/LORA.md).

NormalFloat4 (QLoRA sec. 3, eq. 4): the 16 values are quantiles of N(0, 1), asymmetric so that
0 is exact, normalised to [-1, 1]::

    q_i = Phi^-1(p_i) / max_j |Phi^-1(p_j)|,
    positive side p = linspace(delta, 1/2, 9)[:-1], negative p = linspace(delta, 1/2, 8)[:-1],
    delta = 0.9677083 (bitsandbytes ``create_normal_map``: 1/2 (1/32 + 1/30) from the top)

A weight is flattened and cut into blocks of 64; each block stores 4-bit codes, the nearest
table value to ``w / absmax`` (``w * (1/absmax)``, ties to the lower code), and
``w_hat = q_c * absmax_hat``.

Double quantization (QLoRA sec. 3, "Double Quantization"): the fp32 block absmaxes minus
their mean are quantized again in blocks of 256 with the signed 8-bit dynamic map (Dettmers
2015; bitsandbytes ``create_dynamic_map``): ``absmax_hat = mean + s2 * D[a8]``, ``a8`` uint8,
one fp32 ``s2 = max|absmax - mean|`` per 256 absmaxes (0.127 bit/parameter instead of 0.5).
This is bitsandbytes' ``quantize_4bit(..., quant_type="nf4", compress_statistics=True)``
(0.50.2, its default CPU backend) step for step; ``tests/quant/test_nf4.py`` compares bit for bit
where bitsandbytes imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["NF4_BLOCK", "NF4_DQ_BLOCK", "NF4_TABLE", "NF4Weight", "dynamic_map",
           "nf4_dequantize", "nf4_quantize", "nf4_table_from_quantiles"]

NF4_BLOCK = 64
"""Weights per absmax (QLoRA: 64)."""
NF4_DQ_BLOCK = 256
"""Absmaxes per second-level scale (QLoRA: 256)."""
_OFFSET = 0.9677083

NF4_TABLE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=torch.float32)
"""The NF4 code book (bitsandbytes ``functional.py`` table; equals
:func:`nf4_table_from_quantiles` to float32 rounding)."""


def nf4_table_from_quantiles(offset: float = _OFFSET) -> torch.Tensor:
    """The NF4 values from their definition (QLoRA eq. 4), in float64."""
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    v = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return v / v.abs().max()


@dataclass(frozen=True)
class NF4Weight:
    """A weight in NF4: packed codes, double-quantized block absmaxes, shape and dtype."""

    codes: torch.Tensor
    """uint8 ``[ceil(n/2)]``: two 4-bit codes per byte (low nibble first)."""
    absmax_q: torch.Tensor
    """uint8 ``[ceil(n/64)]``: dynamic-map codes of the centred block absmaxes."""
    absmax_scale: torch.Tensor
    """fp32 ``[ceil(n/64/256)]``: max |absmax - mean| per 256 absmaxes."""
    absmax_mean: torch.Tensor
    """fp32 scalar subtracted before the second quantization."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.codes, self.absmax_q, self.absmax_scale, self.absmax_mean))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "absmax_q": self.absmax_q,
                "absmax_scale": self.absmax_scale, "absmax_mean": self.absmax_mean}


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.reshape(-1, size)


def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic quantization map (bitsandbytes ``create_dynamic_map()``:
    ``max_exponent_bits=7``; 256 sorted values in [-1, 1], 0 and 1 exact)."""
    data: list[float] = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _nearest(scaled: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest value of the sorted ``code`` (ties to the lower one)."""
    return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True)


def _scaled(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = blocks.abs().amax(dim=1)
    return (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1), absmax


def double_quantize_absmax(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(uint8 codes, fp32 scale per 256, fp32 mean)`` of fp32 block absmaxes."""
    mean = absmax.mean()
    scaled, scale = _scaled(_blocks(absmax - mean, NF4_DQ_BLOCK))
    q = _nearest(scaled.reshape(-1)[:absmax.numel()].contiguous(), dynamic_map().to(absmax.device))
    return q.to(torch.uint8), scale, mean


def dequantize_absmax(q: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """fp32 block absmaxes from :func:`double_quantize_absmax`'s output."""
    n = q.numel()
    vals = dynamic_map().to(q.device)[q.long()]
    return (_blocks(vals, NF4_DQ_BLOCK) * scale[:, None]).reshape(-1)[:n] + mean


def nf4_quantize(w: torch.Tensor) -> NF4Weight:
    """NF4 codes of ``w`` (any shape) in blocks of 64, absmax double-quantized.

    Codes are taken against the exact block absmax, the weight is reconstructed with the
    double-quantized one (bitsandbytes' order).
    """
    if not w.is_floating_point():
        raise TypeError(f"nf4_quantize needs a float tensor, got {w.dtype}")
    with torch.no_grad():
        x = w.detach().float()
        if not bool(torch.isfinite(x).all()):
            raise ValueError("nf4_quantize: the weight has non-finite values")
        scaled, absmax = _scaled(_blocks(x, NF4_BLOCK))
        aq, ascale, amean = double_quantize_absmax(absmax)
        codes = _nearest(scaled.reshape(-1)[:x.numel()].contiguous(),
                         NF4_TABLE.to(x.device)).to(torch.uint8)
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        packed = codes[0::2] | (codes[1::2] << 4)
    return NF4Weight(packed, aq, ascale, amean, tuple(w.shape), w.dtype)


def nf4_dequantize(q: NF4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``table[code] * absmax_hat`` per element (fp32), reshaped to the weight."""
    n = 1
    for s in q.shape:
        n *= s
    codes = torch.stack([q.codes & 0xF, q.codes >> 4], dim=1).reshape(-1)[:n].long()
    ahat = dequantize_absmax(q.absmax_q, q.absmax_scale, q.absmax_mean)
    vals = _blocks(NF4_TABLE.to(q.codes.device)[codes], NF4_BLOCK) * ahat[:, None]
    return vals.reshape(-1)[:n].reshape(q.shape).to(dtype or q.dtype)
