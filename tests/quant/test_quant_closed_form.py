"""Every registered format against a reference that shares NO code with the package.

The other quantization tests compare two paths of the package (pack vs fake quant, stacked vs
one at a time) that share their scale helpers: a wrong constant in a helper (say int8's max
code 126 instead of 127) moves both paths alike and passes them. Here the formats are written
out again from their definitions, in numpy float32 arithmetic (IEEE, the same as torch's fp32
kernels), with grids built from the bit layouts:

- ``int8``: per output row, ``s = 127 / amax``, ``q = clamp(rne(w s), -127, 127)``,
  ``weight_scale = 1 / s`` (ModelOpt ``tensor_quant``; SGLang ``w8a8_int8``);
- ``fp8``: per row, ``s = 448 / amax``, ``q = e4m3(w s)``, ``weight_scale = 1 / s``;
- ``fp8_block``: the same per 128 x 128 block, ``weight_scale_inv`` ``[ceil(N/128), K/128]``
  (DeepSeek-V3 layout);
- ``w4a16``: per row and group of 128 inputs, ``s = bf16(amax / 7)``,
  ``q = clamp(rne(w / s), -8, 7)``, eight int4 per int32 word, offset +8, lowest nibble first
  (compressed-tensors ``pack-quantized``);
- ``nvfp4``: ``s2 = bf16_ceil(amax / (6 * 448))`` (fp32 tensor scale), per block of 16
  ``s_blk = e4m3(clamp(amax_blk / (6 s2), 2^-9, 448))``, ``q = e2m1(w / (s_blk s2))``, two
  codes per byte, element 2i in the low nibble (ModelOpt ``NVFP4QTensor``; SGLang
  ``modelopt_fp4``);
- ``bf16``: the tensor unchanged.

Two kinds of checks: weights built on the grid (codes and scales known in closed form) and
random weights (Gaussian, heavy-tailed) bit for bit against the reference, on both the
rollout side (the packed tensors SGLang loads) and the trainer side (``fake_quant_weight``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_qrl.quant import get_spec, list_specs
from tests.quant.quant_cases import QUANT_NAME, gaussian, heavy_tailed

F32 = np.float32
ZERO_AMAX = 2.0**-24  # ModelOpt: an amax at or below 2^-24 quantizes to zero / scale 1

# float8_e4m3fn, non-negative, by code (code = exponent << 3 | mantissa; 0x7f is NaN)
E4M3 = np.array([m / 8 * 2.0**-6 for m in range(8)]
                + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)
                   if (e, m) != (15, 7)])
# E2M1 magnitudes by 3-bit code (OCP MX v1.0 sec. 5.3.3)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _nearest(x: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index, value) of the grid point nearest to ``|x|`` (saturating), ties to the even
    index (= the even mantissa: codes grow by one per grid step)."""
    mag = np.minimum(np.abs(x.astype(np.float64)), grid[-1])
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 0, len(grid) - 1)
    lo = np.clip(hi - 1, 0, len(grid) - 1)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    idx = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return idx, grid[idx]


def e4m3(x: np.ndarray) -> np.ndarray:
    """Round fp32 ``x`` (already within +-448) to the nearest float8_e4m3fn value, as fp32."""
    return np.copysign(_nearest(x, E4M3)[1], x).astype(F32)


def bf16_rne(x: np.ndarray) -> np.ndarray:
    u = x.astype(F32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(F32)


def bf16_ceil(x: np.ndarray) -> np.ndarray:
    """Smallest bf16 value >= ``x`` (x >= 0)."""
    u = x.astype(F32).view(np.uint32)
    t = u & np.uint32(0xFFFF0000)
    return np.where(t != u, t + np.uint32(0x10000), t).astype(np.uint32).view(F32)


def _recip(x):
    """``1 / x`` in fp32. The formats' ``s = MAX / amax`` is ``MAX * (1 / amax)`` in fp32, as
    torch (and so ModelOpt) evaluates a number divided by a tensor (``Tensor.__rtruediv__``:
    ``reciprocal() * number``); a true quotient differs in the last bit for ~20% of rows."""
    return F32(1.0) / np.asarray(x, F32)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


# ---- the references: (packed tensors by suffix as numpy, dequantized weight) ---------------
def ref_int8(w: np.ndarray):
    a = np.abs(w).max(axis=1, keepdims=True)
    zero = a <= ZERO_AMAX
    s = F32(127.0) * _recip(np.where(zero, F32(1.0), a))
    q = np.where(zero, F32(0.0), np.clip(np.rint(w * s), -127, 127))
    scale = np.where(zero, F32(1.0), F32(1.0) / s)
    return {"weight": q, "weight_scale": scale}, q * scale


def ref_fp8(w: np.ndarray):
    a = np.abs(w).max(axis=1, keepdims=True)
    s = F32(448.0) * _recip(np.where(a <= ZERO_AMAX, F32(1.0), a))
    q = e4m3(np.clip(w * s, -448, 448))
    scale = F32(1.0) / s
    return {"weight": q, "weight_scale": scale}, q * scale


def ref_fp8_block(w: np.ndarray):
    n, k = w.shape
    nb = -(-n // 128)
    q = np.zeros_like(w)
    scale = np.zeros((nb, k // 128), F32)
    for i in range(nb):
        for j in range(k // 128):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            a = np.abs(blk).max()
            s = F32(448.0) * _recip(F32(1.0) if a <= ZERO_AMAX else a)
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = e4m3(np.clip(blk * s, -448, 448))
            scale[i, j] = F32(1.0) / s
    expand = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:n]
    return {"weight": q, "weight_scale_inv": scale}, q * expand


def ref_w4a16(w: np.ndarray):
    n, k = w.shape
    g = w.reshape(n, k // 128, 128)
    a = np.abs(g).max(axis=2, keepdims=True)
    s = bf16_rne(np.where(a <= ZERO_AMAX, F32(1.0), a / F32(7.0)))
    q = np.clip(np.rint(g / s), -8, 7)
    return {"weight": q.reshape(n, k), "weight_scale": s[..., 0]}, (q * s).reshape(n, k)


def ref_nvfp4(w: np.ndarray, global_amax: float | None = None):
    n, k = w.shape
    ga = F32(np.abs(w).max() if global_amax is None else global_amax)
    s2 = bf16_ceil(np.array(ga / F32(6 * 448.0), F32))
    s2 = F32(1.0) if s2 == 0 else F32(s2)
    b = w.reshape(n, k // 16, 16)
    sb = np.abs(b).max(axis=2, keepdims=True) / (F32(6.0) * s2)
    sb = e4m3(np.clip(np.where(sb == 0, F32(1.0), sb), 2.0**-9, 448.0))
    d = sb * s2
    x = b / d
    idx, mag = _nearest(x, E2M1)
    codes = (np.where(x < 0, 8, 0) + idx).reshape(n, k)
    vals = np.where(x < 0, -mag, mag).astype(F32)
    return ({"weight": codes, "weight_scale": sb[..., 0], "weight_scale_2": s2,
             "input_scale": F32(1.0)}, (vals * d).reshape(n, k))


def ref_bf16(w: np.ndarray):
    return {"weight": w}, w


REFERENCES = {"bf16": ref_bf16, "int8": ref_int8, "fp8": ref_fp8, "fp8_block": ref_fp8_block,
              "w4a16": ref_w4a16, "nvfp4": ref_nvfp4}


# ---- reading the packed tensors without the package ---------------------------------------
def _unpack_int32_words(words: np.ndarray) -> np.ndarray:
    u = words.astype(np.int64) & 0xFFFFFFFF
    nib = np.stack([(u >> (4 * i)) & 0xF for i in range(8)], axis=-1)
    return (nib - 8).reshape(words.shape[0], -1)


def _unpack_bytes(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)


def packed_as_reference(name: str, packed: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The package's packed tensors in the reference's terms (codes as values / integers)."""
    suffix = {k.rsplit(".", 1)[-1]: v for k, v in packed.items()}
    if name == "w4a16":
        assert suffix["weight_packed"].dtype == torch.int32
        return {"weight": _unpack_int32_words(suffix["weight_packed"].numpy()),
                "weight_scale": _np(suffix["weight_scale"])}
    if name == "nvfp4":
        assert suffix["weight"].dtype == torch.uint8
        assert suffix["weight_scale"].dtype == torch.float8_e4m3fn
        return {"weight": _unpack_bytes(suffix["weight"].numpy()),
                **{k: _np(v) for k, v in suffix.items() if k != "weight"}}
    return {k: _np(v) for k, v in suffix.items()}


def _check(name: str, w: torch.Tensor, global_amax: float | None = None) -> None:
    spec = get_spec(name)
    ref = REFERENCES[name]
    want, want_w = ref(_np(w)) if global_amax is None else ref(_np(w), global_amax)
    got = packed_as_reference(name, dict(spec.pack(QUANT_NAME, w, global_amax=global_amax)))
    assert set(got) == set(want), f"{name}: packed tensors {sorted(got)} != {sorted(want)}"
    for key in want:
        g, e = np.asarray(got[key], np.float64), np.asarray(want[key], np.float64)
        assert g.shape == np.shape(e), f"{name}.{key}: shape {g.shape} != {np.shape(e)}"
        bad = int((g != e).sum())
        assert bad == 0, f"{name}.{key}: {bad} of {g.size} values differ from the reference"
    trainer = _np(spec.fake_quant_weight(w, global_amax=global_amax).float())
    expected = want_w.astype(F32)
    if w.dtype != torch.float32:  # the trainer's weight is in the weight's dtype
        expected = _np(torch.from_numpy(expected).to(w.dtype))
    bad = int((trainer != expected).sum())
    assert bad == 0, f"{name}: {bad} of {trainer.size} fake-quant values differ from the reference"


def test_every_registered_format_has_a_reference():
    assert set(list_specs()) == set(REFERENCES)


@pytest.mark.parametrize("name", list(REFERENCES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", [gaussian, heavy_tailed])
def test_random_weights_match_the_reference_bit_for_bit(name, dtype, weights):
    _check(name, weights(out=256, k=384, dtype=dtype))


def test_partial_edge_blocks_and_zero_rows():
    w = gaussian(out=200, k=256)
    w[7] = 0.0
    w[130:200, 128:] = 1e-30  # a block whose amax is below 2^-24
    for name in REFERENCES:
        if name != "w4a16" or w.shape[1] % 128 == 0:
            _check(name, w)


def test_nvfp4_shared_global_amax():
    w = gaussian(out=64, k=64)
    _check("nvfp4", w, global_amax=float(w.abs().max()) * 3)


# ---- weights on the grid: codes and scales known in closed form ----------------------------
def _codes_and_scale(name: str, w: torch.Tensor):
    got = packed_as_reference(name, dict(get_spec(name).pack(QUANT_NAME, w)))
    return got["weight"], got


def test_int8_grid():
    delta = 2.0 ** -np.arange(3, 11, dtype=np.float64)[:, None]  # one power of two per row
    c = np.tile(np.arange(-127, 129, dtype=np.float64)[:256], (8, 1))
    c[:, -1] = 127  # every row reaches the max code
    w = torch.from_numpy((c * delta).astype(F32))
    codes, got = _codes_and_scale("int8", w)
    assert np.array_equal(codes, c) and np.array_equal(got["weight_scale"], delta)
    assert codes.max() == 127 and codes.min() == -127
    assert torch.equal(get_spec("int8").fake_quant_weight(w), w)


def test_fp8_grid():
    v = np.concatenate([E4M3, -E4M3])  # 254 values, +-448 included
    delta = 2.0 ** -np.arange(2, 6, dtype=np.float64)[:, None]
    w = torch.from_numpy((np.tile(np.pad(v, (0, 2)), (4, 1)) * delta).astype(F32))
    codes, got = _codes_and_scale("fp8", w)
    assert np.array_equal(codes, np.tile(np.pad(v, (0, 2)), (4, 1)))
    assert np.array_equal(got["weight_scale"], delta)
    assert torch.equal(get_spec("fp8").fake_quant_weight(w), w)


def test_fp8_block_grid():
    rng = np.random.default_rng(0)
    v = rng.choice(np.concatenate([E4M3, -E4M3]), size=(256, 256))
    v[0, 0] = v[0, 128] = v[128, 0] = v[128, 128] = 448.0  # each block reaches the max
    delta = np.array([[2.0**-3, 2.0**-5], [2.0**-7, 2.0**-9]])
    w = v * np.repeat(np.repeat(delta, 128, axis=0), 128, axis=1)
    codes, got = _codes_and_scale("fp8_block", torch.from_numpy(w.astype(F32)))
    assert np.array_equal(codes, v) and np.array_equal(got["weight_scale_inv"], delta)


def test_w4a16_grid():
    rng = np.random.default_rng(1)
    c = rng.integers(-7, 8, size=(4, 256)).astype(np.float64)
    c[:, 0] = 7  # each group reaches the max code (7: the scale is amax / 7)
    c[:, 128] = -7
    delta = np.array([[2.0**-4, 2.0**-6], [2.0**-5, 2.0**-9], [1.0, 2.0**-1], [2.0**-12, 4.0]])
    w = c * np.repeat(delta, 128, axis=1)
    codes, got = _codes_and_scale("w4a16", torch.from_numpy(w.astype(F32)))
    assert np.array_equal(codes, c) and np.array_equal(got["weight_scale"], delta)


def test_nvfp4_grid():
    rng = np.random.default_rng(2)
    s2 = 2.0**-10  # amax = 6 * 448 * s2 gives exactly this fp32 tensor scale
    sblk = rng.choice(E4M3[E4M3 >= 2.0**-6], size=(2, 4))
    sblk[0, 0] = 448.0
    v = rng.choice(np.concatenate([E2M1, -E2M1[1:]]), size=(2, 64))
    v[:, ::16] = 6.0  # each block reaches the max E2M1 value
    w = v * np.repeat(sblk, 16, axis=1) * s2
    codes, got = _codes_and_scale("nvfp4", torch.from_numpy(w.astype(F32)))
    signs = np.where(v < 0, 8, 0)
    assert np.array_equal(codes, signs + np.searchsorted(E2M1, np.abs(v)))
    assert np.array_equal(got["weight_scale"], sblk) and got["weight_scale_2"] == s2
    assert got["input_scale"] == 1.0


def test_reference_grids():
    """The grids themselves, from their definitions."""
    assert len(E4M3) == 127 and E4M3[-1] == 448 and E4M3[1] == 2.0**-9
    assert np.all(np.diff(E4M3) > 0)
    assert float(torch.tensor(E4M3, dtype=torch.float32).to(torch.float8_e4m3fn).float()
                 .sub(torch.tensor(E4M3, dtype=torch.float32)).abs().max()) == 0.0
    assert bf16_ceil(np.array([1.0 + 2.0**-10], F32))[0] == 1.0 + 2.0**-7
    assert bf16_rne(np.array([1.0 + 2.0**-8], F32))[0] == 1.0  # the tie goes to even


def test_ties_round_to_even():
    """Values exactly halfway between two codes go to the even one (RNE; E2M1: even mantissa)."""
    # w4a16: scale 2^-5 exactly (amax 7 * 2^-5); w / s = k + 0.5
    half = np.array([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, -0.5, -1.5, -2.5, -6.5])
    c = np.zeros((1, 128))
    c[0, 0] = 7.0
    c[0, 1:1 + len(half)] = half
    w = torch.from_numpy((c * 2.0**-5).astype(F32))
    codes, got = _codes_and_scale("w4a16", w)
    assert got["weight_scale"][0, 0] == 2.0**-5
    want = [0, 2, 2, 4, 4, 6, 6, 0, -2, -2, -6]
    assert list(codes[0, 1:1 + len(half)]) == want
    trainer = get_spec("w4a16").fake_quant_weight(w)[0, 1:1 + len(half)]  # the trainer's side
    assert trainer.tolist() == [x * 2.0**-5 for x in want]
    # nvfp4: tensor scale 2^-10 (a second block reaches 6 * 448 * 2^-10), block scale 1
    # (amax 6 * 2^-10); x = the E2M1 midpoints
    pos = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    mids = np.array(pos + [-m for m in pos])
    v = np.zeros((1, 32))
    v[0, 0], v[0, 16] = 6.0, 6.0 * 448
    v[0, 1:1 + len(mids)] = mids
    w = torch.from_numpy((v * 2.0**-10).astype(F32))
    codes, got = _codes_and_scale("nvfp4", w)
    assert got["weight_scale_2"] == 2.0**-10 and got["weight_scale"][0, 0] == 1.0
    mags = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert list(E2M1[codes[0, 1:1 + len(mids)] & 7]) == mags * 2
    assert list(codes[0, 1:1 + len(mids)] >= 8) == [False] * 7 + [True] * 7
    trainer = get_spec("nvfp4").fake_quant_weight(w)[0, 1:1 + len(mids)]
    assert trainer.tolist() == [x * 2.0**-10 for x in mags + [-m for m in mags]]
