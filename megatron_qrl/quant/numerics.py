"""Pure-torch numerics shared by the reference quantizers (all exact, all run on CPU).

Nothing here knows about formats or checkpoints: only rounding, casting, block reshapes and
bit packing. Every format in :mod:`megatron_qrl.quant.formats` is built from these.
"""

from __future__ import annotations

import functools

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
# ModelOpt's rule (tensor_quant._tensor_quant): amax at or below 2**-24 quantizes to zero.
ZERO_AMAX_EPS = 1.0 / (1 << 24)

# E2M1 magnitudes by 3-bit ordinal, and the rounding midpoints between them.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@functools.cache
def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A constant fp32 lookup table on ``device``, built once (a host-to-device copy per call
    would wait for the GPU every time)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A cached fp32 constant ``[len(values)]`` on ``device`` (see :func:`_table`)."""
    return _table(tuple(values), device)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero (CUDA ``libdevice.round``, used by Triton kernels)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def amax(x: torch.Tensor, dim: int | tuple[int, ...], keepdim: bool = True) -> torch.Tensor:
    """Absolute maximum in fp32 along ``dim``."""
    return x.float().abs().amax(dim=dim, keepdim=keepdim)


def bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest bf16-representable value >= x (fp32 in, fp32 out; x finite, >= 0)."""
    b = x.float().to(torch.bfloat16)
    up = torch.nextafter(b, torch.full_like(b, float("inf")))
    return torch.where(b.float() < x.float(), up, b).float()


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to ``float8_e4m3fn`` (round-to-nearest-even, clamp to +-448 first)."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Encode fp32 values (already divided by their scale) as 4-bit E2M1 codes (uint8).

    Code = sign << 3 | ordinal. Round to nearest with ties to the even mantissa, saturating at
    6 (OCP MX spec v1.0 sec. 5.3.3; identical to ModelOpt ``NVFP4QTensor._cast_fp4``).
    """
    bounds = _table(_E2M1_BOUNDS, x.device)
    mag = x.float().abs()
    ordinal = torch.searchsorted(bounds, mag.contiguous(), out_int32=True)
    # a tie sits on a bound; searchsorted(left) sends it down, which is "even" for the
    # bounds 0.25, 1.25, 2.5, 5.0 and "odd" for 0.75, 1.75, 3.5 -> bump those up.
    odd_ties = (mag == 0.75) | (mag == 1.75) | (mag == 3.5)
    ordinal = ordinal + odd_ties.to(torch.int32)
    sign = (x < 0).to(torch.int32)
    return ((sign << 3) | ordinal).to(torch.uint8)


def _pred(x: float) -> float:
    """The largest fp32 value below ``x``."""
    t = torch.tensor(x, dtype=torch.float32)
    return float(torch.nextafter(t, torch.tensor(-float("inf"))))


# e2m1_round: sorted fp32 thresholds on the SIGNED scaled value and the 16 signed E2M1 values
# between them, V[i] for T[i-1] < x <= T[i]. A tie point p that e2m1_encode sends up (away
# from -inf) gets the threshold pred(p) (no fp32 value lies strictly between); one it sends
# down keeps p. Zero: x in [-0.25, 0) decodes to -0.0 (sign bit, ordinal 0); x = +-0.0 to +0.0.
_E2M1_SIGNED_THRESHOLDS = (
    _pred(-5.0), -3.5, _pred(-2.5), -1.75, _pred(-1.25), -0.75, _pred(-0.25), _pred(0.0),
    0.25, _pred(0.75), 1.25, _pred(1.75), 2.5, _pred(3.5), 5.0,
)
_E2M1_SIGNED_VALUES = (
    -6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """``e2m1_decode(e2m1_encode(x))`` bit for bit (signed zeros included), in two kernels:
    a ``searchsorted`` of the fp32 value into 15 signed thresholds and a 16-entry table lookup.

    The same rounding as :func:`e2m1_encode` (OCP MX spec v1.0 sec. 5.3.3: nearest, ties to
    the even mantissa, saturating at 6; QeRL seed 002 / docs/ALGORITHMS.md sec. 3) without building
    codes: the odd ties 0.75, 1.75, 3.5 (and their negatives' mirror images) are encoded in
    the thresholds instead of a fix-up pass.
    """
    thresholds = _table(_E2M1_SIGNED_THRESHOLDS, x.device)
    idx = torch.searchsorted(thresholds, x.float().contiguous(), out_int32=True)
    return _table(_E2M1_SIGNED_VALUES, x.device)[idx]


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit E2M1 codes (uint8, one code per element) to fp32."""
    values = _table(_E2M1_VALUES, codes.device)
    c = codes.to(torch.int64)
    mag = values[c & 0x7]
    return torch.where((c & 0x8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes along the last dim, two per byte, element 2i in the LOW nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd last dimension {codes.shape[-1]} into nibbles")
    c = codes.to(torch.uint8)
    return (c[..., 1::2] << 4) | (c[..., 0::2] & 0xF)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    lo = packed & 0xF
    hi = (packed >> 4) & 0xF
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_int4_to_int32(q: torch.Tensor) -> torch.Tensor:
    """Pack signed int4 values in [-8, 7] eight per int32 along the last dim.

    compressed-tensors ``pack_to_int32`` layout: each value is offset by +8 to an unsigned
    nibble and element ``8j+i`` goes to bits ``4i..4i+3`` of word ``j`` (lowest first).
    """
    if q.shape[-1] % 8:
        raise ValueError(f"cannot pack last dimension {q.shape[-1]} into int32 words of 8")
    u = (q.to(torch.int64) + 8) & 0xF
    u = u.view(*q.shape[:-1], q.shape[-1] // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    word = (u << shifts).sum(dim=-1)
    # keep the two's-complement bit pattern when narrowing to int32
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def unpack_int32_to_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_to_int32`: int32 words -> int8 values in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    u = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    return (u - 8).flatten(-2).to(torch.int8)


def to_blocks_2d(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """View a [N, K] tensor as [ceil(N/bn), bn, ceil(K/bk), bk] blocks, zero-padding the edges.

    Zero padding never changes a block's absmax, so partial edge blocks (DeepSeek-V3 FP8
    layout: scale shape ``[ceil(N/128), ceil(K/128)]``) quantize as if cropped.
    """
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    if nb * bn == n and kb * bk == k:  # whole blocks: a view, no copy
        return w.reshape(nb, bn, kb, bk), (n, k)
    padded = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n))
    return padded.view(nb, bn, kb, bk), (n, k)


def from_blocks_2d(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`to_blocks_2d` (crops the padding)."""
    nb, bn, kb, bk = blocks.shape
    return blocks.reshape(nb * bn, kb * bk)[: shape[0], : shape[1]]


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|x|^2 / |x - x_hat|^2)."""
    ref = reference.double()
    err = (ref - approx.double()).pow(2).sum()
    if err == 0:
        return float("inf")
    return float(10.0 * torch.log10(ref.pow(2).sum() / err))
