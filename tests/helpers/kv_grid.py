"""Test-side reference of the FP8 KV-cache rounding, written from the format definitions
(OCP FP8 spec: E4M3FN bias 7, no inf, max 448; E5M2 bias 15, IEEE-like, max 57344) by
enumerating every finite code; shares no code with megatron_qrl/quant/kv_cache.py."""

from __future__ import annotations

import bisect


def positive_grid(fmt: str) -> list[float]:
    """All finite non-negative values of the format, ascending; list index = code."""
    if fmt == "fp8_e4m3":
        ebits, mbits, bias = 4, 3, 7
        top = [(2**ebits - 1, m) for m in range(2**mbits - 1)]  # e=15, m=7 is NaN
        normals = [(e, m) for e in range(1, 2**ebits - 1) for m in range(2**mbits)] + top
    else:
        ebits, mbits, bias = 5, 2, 15
        normals = [(e, m) for e in range(1, 2**ebits - 1) for m in range(2**mbits)]
    sub = [m * 2.0 ** (1 - bias - mbits) for m in range(2**mbits)]
    return sub + [(1 + m / 2**mbits) * 2.0 ** (e - bias) for e, m in normals]


def round_half_even(x: float, grid: list[float]) -> float:
    """Nearest grid value to ``x`` (ties to the even code); beyond the top: ``inf`` (the
    caller decides how overflow is represented)."""
    a = abs(x)
    i = bisect.bisect_left(grid, a)
    if i < len(grid) and grid[i] == a:
        r = a
    elif i == len(grid):
        step = grid[-1] - grid[-2]
        mid = grid[-1] + step / 2
        over = a > mid or (a == mid and (len(grid) - 1) % 2 == 1)
        r = float("inf") if over else grid[-1]
    else:
        lo, hi = grid[i - 1], grid[i]
        if a - lo < hi - a:
            r = lo
        elif hi - a < a - lo:
            r = hi
        else:
            r = lo if (i - 1) % 2 == 0 else hi
    return -r if x < 0 else r
