"""SGLang's Marlin layout of 4-bit weights as pure tensor permutations, both ways.

What SGLang 0.5.17 keeps after loading a compressed-tensors WNA16 checkpoint (4 bits,
symmetric, grouped, no act order) on the Marlin path, read from its source:

* codes: ``gptq_marlin_repack`` (``kernels/jit/csrc/gemm/marlin/gptq_marlin_repack.cuh``) of
  the checkpoint's ``weight_packed`` ``[N, K/8]`` viewed as ``[K/8, N]``: every 16 (K) x 64 (N)
  tile goes to its own 128 int32 words, output row ``K/16``, words ``[128 nt, 128 nt + 128)``;
  word ``4 lane + warp`` (warp < 4, lane < 32) holds the nibbles at
  ``k = 2 (lane % 4) + {0, 1, 8, 9}``, ``n = 16 warp + lane / 4 + {0, 8}`` in the order
  ``{0, 2, 4, 6, 1, 3, 5, 7}``. Nibble values are moved, never changed.
* scales: ``marlin_permute_scales`` (``layers/quantization/marlin_utils.py``) of the
  transposed ``[K/group, N]`` scale: the columns of every run of 64 reordered by ``i + 8 j``
  (``scale_perm``) when the group is shorter than K, else of every run of 8 by
  ``scale_perm_single``.

The MoE variants (``gptq_marlin_moe_repack``, ``marlin_moe_permute_scales``) are the same per
expert: here a leading expert dim is just another batch dim. These functions are the
reference the direct writer and the engine's read-back share (design:
docs/gpu_sglang_engine_sync.md, "w4a16"); tests/gpu/test_marlin_layout.py compares them with
SGLang's own kernels.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["MarlinUnsupported", "from_live", "marlin_from_codes", "marlin_repack", "marlin_scales",
           "checkpoint_shape", "live_shape", "marlin_unpack", "marlin_unscales", "repack_rows",
           "repacker", "to_live"]


class MarlinUnsupported(ValueError):
    """A weight or engine setting the Marlin layout functions do not cover (names the fix)."""

TILE_K, TILE_N = 16, 64
_SHIFTS = tuple(range(0, 32, 4))


@functools.cache
def _tile_order() -> tuple[int, ...]:
    """Flat tile positions ``k * 64 + n`` in output order (word ``4 lane + warp``, nibble i)."""
    words: dict[int, list[int]] = {}
    for warp in range(4):
        for lane in range(32):
            row, col = (lane % 4) * 2, warp * 16 + lane // 4
            vals = [(row + dk) * TILE_N + col for dk in (0, 1, 8, 9)]
            vals += [(row + dk) * TILE_N + col + 8 for dk in (0, 1, 8, 9)]
            words[4 * lane + warp] = [vals[i] for i in (0, 2, 4, 6, 1, 3, 5, 7)]
    return tuple(p for w in range(128) for p in words[w])


@functools.cache
def _scale_order(grouped: bool) -> tuple[int, ...]:
    if grouped:
        return tuple(i + 8 * j for i in range(8) for j in range(8))
    return tuple(2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25))


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=words.device)
    return ((words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=nibbles.device)
    w = (nibbles.unflatten(-1, (-1, 8)).to(torch.int64) << shifts).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)  # keep the bit pattern


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with row-major strides, size-1 dims included (``contiguous()`` keeps a transposed
    ``[..., N, 1]``'s stride, which byte views refuse)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _check(n: int, k: int, what: str) -> None:
    if k % TILE_K or n % TILE_N:
        raise MarlinUnsupported(f"Marlin layout: {what} has N={n}, K={k}; Marlin tiles need N % 64 == 0 "
                         "and K % 16 == 0")


def _repack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` nibbles (0..15) -> ``[..., K/16, 2N]`` Marlin words."""
    *lead, n, k = codes.shape
    order = torch.tensor(_tile_order(), device=codes.device)
    tiles = codes.transpose(-1, -2).reshape(*lead, k // TILE_K, TILE_K, n // TILE_N, TILE_N)
    tiles = tiles.transpose(-3, -2).reshape(*lead, k // TILE_K, n // TILE_N, TILE_K * TILE_N)
    return _words(tiles.index_select(-1, order)).reshape(*lead, k // TILE_K, 2 * n)


def marlin_repack(packed: torch.Tensor) -> torch.Tensor:
    """``[..., N, K/8]`` compressed-tensors words -> ``[..., K/16, 2N]`` Marlin words."""
    *lead, n, k8 = packed.shape
    _check(n, 8 * k8, "weight_packed")
    return _repack_nibbles(_nibbles(packed).reshape(*lead, n, 8 * k8))


def marlin_from_codes(codes: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes ``[..., N, K]`` (in [-8, 7]) -> ``[..., K/16, 2N]`` Marlin words:
    :func:`marlin_repack` of their compressed-tensors words (nibble = code + 8, SGLang's
    ``uint4b8``) without making those words."""
    *lead, n, k = codes.shape
    _check(n, k, "int4 codes")
    return _repack_nibbles(codes.to(torch.int64) + 8)


def marlin_unpack(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`marlin_repack`: ``[..., K/16, 2N]`` -> ``[..., N, K/8]``."""
    *lead, kt, n2 = words.shape
    n, k = n2 // 2, kt * TILE_K
    _check(n, k, "Marlin weight")
    inverse = torch.argsort(torch.tensor(_tile_order(), device=words.device))
    tiles = _nibbles(words.reshape(*lead, kt, n // TILE_N, 128)).index_select(-1, inverse)
    codes = tiles.reshape(*lead, kt, n // TILE_N, TILE_K, TILE_N).transpose(-3, -2)
    return _words(codes.reshape(*lead, k, n).transpose(-1, -2).contiguous())


def marlin_scales(scale: torch.Tensor, grouped: bool) -> torch.Tensor:
    """``[..., N, K/group]`` checkpoint scales -> ``[..., K/group, N]`` as Marlin reads them;
    ``grouped``: the group is shorter than K (SGLang's ``group_size < size_k``)."""
    t = scale.transpose(-1, -2)
    order = torch.tensor(_scale_order(grouped), device=scale.device)
    if t.shape[-1] % len(order):
        raise MarlinUnsupported(f"Marlin layout: scales of N={t.shape[-1]} rows; Marlin's scale "
                                f"permutation needs N % {len(order)} == 0")
    runs = t.reshape(*t.shape[:-1], -1, len(order)).index_select(-1, order)
    return _dense(runs.reshape(t.shape))


def marlin_unscales(scale: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Inverse of :func:`marlin_scales`."""
    inverse = torch.argsort(torch.tensor(_scale_order(grouped), device=scale.device))
    runs = scale.reshape(*scale.shape[:-1], -1, len(inverse)).index_select(-1, inverse)
    return _dense(runs.reshape(scale.shape).transpose(-1, -2))


def repack_rows(repack_2d, packed: torch.Tensor) -> torch.Tensor:
    """``[..., N, K/8]`` words -> ``[..., K/16, 2N]`` Marlin words through ONE call of
    ``repack_2d`` (``[N', K/8]`` -> ``[K/16, 2N']``) on the leading slices' rows concatenated:
    a Marlin tile spans 64 rows (N) and never two slices (N % 64 == 0), and the words of
    output tile ``nt`` are columns ``[128 nt, 128 nt + 128)``, so slice ``e``'s words are
    columns ``[2N e, 2N (e + 1))`` of the concatenation's. Returns a view of that one
    ``[K/16, 2N']`` result (strided: a copy into the engine's stack places it)."""
    *lead, n, k8 = packed.shape
    _check(n, 8 * k8, "weight_packed")
    slices = math.prod(lead)
    out = repack_2d(packed.reshape(slices * n, k8))  # [K/16, 2 N slices]
    if not lead:
        return out
    return out.view(out.shape[0], slices, 2 * n).transpose(0, 1).unflatten(0, tuple(lead))


def repacker(device: torch.device):
    """The function that turns ``[..., N, K/8]`` compressed-tensors words into Marlin words on
    ``device``: ``sgl_kernel.gptq_marlin_repack`` (no act-order perm; an expert stack in one
    call, :func:`repack_rows`) where the device is CUDA and sgl_kernel imports, else
    :func:`marlin_repack` (the same words; tests/gpu/test_marlin_layout.py holds them
    equal)."""
    if torch.device(device).type != "cuda":
        return marlin_repack
    try:
        from sgl_kernel import gptq_marlin_repack
    except ImportError:
        return marlin_repack

    def kernel_2d(words: torch.Tensor) -> torch.Tensor:
        n, k8 = words.shape
        perm = torch.empty(0, dtype=torch.int32, device=words.device)
        return gptq_marlin_repack(words.t().contiguous(), perm, 8 * k8, n, 4)

    return lambda packed: repack_rows(kernel_2d, packed)


def to_live(kind: str, packed: torch.Tensor) -> torch.Tensor:
    """A packed tensor in the checkpoint's layout -> what a Marlin parameter of ``kind`` holds:
    ``codes`` (:func:`repacker`), ``scales`` / ``scales_single`` (:func:`marlin_scales`,
    grouped or not)."""
    if kind == "codes":
        return repacker(packed.device)(packed)
    return marlin_scales(packed, kind == "scales")


def from_live(kind: str, live: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_live` (the engine's read-back)."""
    if kind == "codes":
        return marlin_unpack(live.contiguous())
    return marlin_unscales(live.contiguous(), kind == "scales")


def live_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The live shape of a packed tensor of checkpoint ``shape`` (``[..., N, K/8]`` codes ->
    ``[..., K/16, 2N]``; ``[..., N, G]`` scales -> ``[..., G, N]``)."""
    *lead, n, c = shape
    return (*lead, c // 2, 2 * n) if kind == "codes" else (*lead, c, n)


def checkpoint_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Inverse of :func:`live_shape`."""
    *lead, r, c = shape
    return (*lead, c // 2, 2 * r) if kind == "codes" else (*lead, c, r)
