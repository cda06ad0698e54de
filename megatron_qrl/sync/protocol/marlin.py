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

import torch

__all__ = ["marlin_repack", "marlin_scales", "marlin_unpack", "marlin_unscales"]

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


def _check(n: int, k: int, what: str) -> None:
    if k % TILE_K or n % TILE_N:
        raise ValueError(f"Marlin layout: {what} has N={n}, K={k}; Marlin tiles need N % 64 == 0 "
                         "and K % 16 == 0")


def marlin_repack(packed: torch.Tensor) -> torch.Tensor:
    """``[..., N, K/8]`` compressed-tensors words -> ``[..., K/16, 2N]`` Marlin words."""
    *lead, n, k8 = packed.shape
    k = 8 * k8
    _check(n, k, "weight_packed")
    order = torch.tensor(_tile_order(), device=packed.device)
    codes = _nibbles(packed).transpose(-1, -2)  # [..., K, N]
    tiles = codes.reshape(*lead, k // TILE_K, TILE_K, n // TILE_N, TILE_N).transpose(-3, -2)
    tiles = tiles.reshape(*lead, k // TILE_K, n // TILE_N, TILE_K * TILE_N)
    return _words(tiles.index_select(-1, order)).reshape(*lead, k // TILE_K, 2 * n)


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
    runs = t.reshape(*t.shape[:-1], -1, len(order)).index_select(-1, order)
    return runs.reshape(t.shape).contiguous()


def marlin_unscales(scale: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Inverse of :func:`marlin_scales`."""
    inverse = torch.argsort(torch.tensor(_scale_order(grouped), device=scale.device))
    runs = scale.reshape(*scale.shape[:-1], -1, len(inverse)).index_select(-1, inverse)
    return runs.reshape(scale.shape).transpose(-1, -2).contiguous()
