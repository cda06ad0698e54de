"""Learning-curve statistics: window means, a fitted slope with its interval, seed bands.

Pure functions on lists of floats (no torch): the job's summary line, the compare table and
its plot read a run through these, so a curve is never judged on 5-step endpoints.

* :func:`window_change`: mean of the first ``w`` and of the last ``w`` values (``w`` = 10
  when the curve has at least 20 points, else half of it), their difference, and the
  least-squares slope over all points with a 95% interval (``slope +- t * SE``; ``t`` from a
  small Student-t table, normal beyond 30 degrees of freedom). The interval assumes
  independent residuals; successive RL steps are correlated, so read it as a lower bound
  on the uncertainty.
* :func:`mean_std`: mean and sample standard deviation (``ddof = 1``; 0 for one value).
* :func:`band`: per-step mean and standard deviation over several runs' curves (truncated
  to the shortest), for the compare plot's bands; :func:`rolling_mean` smooths a curve first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["WINDOW", "WindowChange", "band", "mean_std", "rolling_mean", "summary_line",
           "window_change"]

WINDOW = 10
"""Steps averaged at each end of a curve (never fewer than 10 when the curve allows it)."""

_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}
"""Two-sided 95% Student-t quantiles by degrees of freedom."""


def t95(dof: int) -> float:
    """Two-sided 95% Student-t quantile for ``dof`` degrees of freedom (conservative: the
    next tabulated smaller dof; 1.96 beyond 30)."""
    if dof < 1:
        raise ValueError(f"t95: need >= 1 degree of freedom, got {dof}")
    if dof > 30:
        return 1.96
    return _T95[max(k for k in _T95 if k <= dof)]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample std with ddof=1)``; std is 0 for a single value."""
    if not values:
        raise ValueError("mean_std: no values")
    n = len(values)
    m = sum(values) / n
    if n == 1:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))


def fit_slope(values: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope of ``values`` against ``0..n-1`` and its 95% half-width."""
    n = len(values)
    if n < 3:
        raise ValueError(f"fit_slope: need >= 3 points, got {n}")
    xm, ym = (n - 1) / 2, sum(values) / n
    sxx = sum((i - xm) ** 2 for i in range(n))
    slope = sum((i - xm) * (v - ym) for i, v in enumerate(values)) / sxx
    resid = sum((v - ym - slope * (i - xm)) ** 2 for i, v in enumerate(values))
    se = math.sqrt(resid / (n - 2) / sxx)
    return slope, t95(n - 2) * se


@dataclass(frozen=True)
class WindowChange:
    """First-window mean, last-window mean and fitted slope of one curve."""

    n: int
    window: int
    first: float
    last: float
    slope: float | None
    """Per step (None below 3 points)."""
    slope_ci: float | None
    """95% half-width of ``slope``."""

    @property
    def change(self) -> float:
        return self.last - self.first


def window_change(values: Sequence[float], window: int = WINDOW) -> WindowChange:
    """Window means at both ends of ``values`` (``window``, or half the curve when it has
    fewer than ``2 * window`` points) and the fitted slope (see the module docstring)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"window_change: need >= 2 values, got {n}")
    w = min(window, n // 2)
    slope, ci = fit_slope(values) if n >= 3 else (None, None)
    return WindowChange(n, w, sum(values[:w]) / w, sum(values[-w:]) / w, slope, ci)


def summary_line(values: Sequence[float], name: str = "accuracy") -> str:
    """One line for the job's end: window means, their change, the slope and its interval."""
    wc = window_change(values)
    text = (f"RL {name}: mean of the first {wc.window} steps {wc.first:.3f} -> last "
            f"{wc.window} steps {wc.last:.3f} ({wc.change:+.3f}, {wc.n} steps)")
    if wc.slope is not None:
        text += f"; fitted slope {wc.slope:+.4f} +- {wc.slope_ci:.4f} per step (95%)"
    return text


def rolling_mean(values: Sequence[float], window: int = WINDOW) -> list[float]:
    """Trailing mean over up to ``window`` values (the first points average what exists)."""
    if window < 1:
        raise ValueError(f"rolling_mean: window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def band(curves: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """Per-step ``(means, stds)`` over ``curves`` (each truncated to the shortest)."""
    if not curves:
        raise ValueError("band: no curves")
    n = min(len(c) for c in curves)
    stats = [mean_std([c[i] for c in curves]) for i in range(n)]
    return [m for m, _ in stats], [s for _, s in stats]
