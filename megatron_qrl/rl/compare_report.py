"""The ``--qrl-compare`` report: per-run columns, mean +- std over seeds, curves with bands.

``runs`` maps a variant label to ``{seed: metrics records}`` (the records of the RL steps;
SFT records are ignored). Columns (:data:`COLUMNS`, one value per run, then mean +- std
over the seeds, :func:`megatron_qrl.utils.curves.mean_std`):

* accuracy of the first / last :data:`~megatron_qrl.utils.curves.WINDOW` RL steps and their
  change (``accuracy`` = fraction of samples with a correct answer),
* mismatch KL: mean over steps of the k3 estimate of KL(pi_behav || pi_prox) on the rollout
  tokens (first update of each step); max ratio: the largest pi_prox / pi_behav of any token,
* TIS-truncated tokens: mean fraction with pi_prox / pi_behav > C (the tokens where ACR
  differs from TIS, QuRL eq. 9); clip fraction,
* early rollout NLL: mean over the first half of the steps of the sampled tokens' negative
  log-probability under the rollout policy (a Monte-Carlo estimate of its entropy, the
  quantity AQN's noise acts on); early entropy: the trainer policy's entropy, same steps,
* visible updates: of the linear-layer weights that moved between the run's last two
  checkpoints, the fraction whose value in the rollout format moved too
  (:func:`visible_update_fraction`; QuRL's UAQ claim, eq. 10-12), written by
  :func:`megatron_qrl.rl.compare.run_compare` into the run's last record.

``compare.png``: accuracy against RL step (each run smoothed by a trailing 10-step mean, then
mean over seeds, band +- 1 std), the rollout NLL and the mismatch KL (log scale), the same
way, one line per variant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_qrl.utils.curves import WINDOW, band, mean_std, rolling_mean, window_change
from megatron_qrl.utils.io import atomic_write_text
from megatron_qrl.utils.plots import new_figure, save_png

__all__ = ["COLUMNS", "VISIBLE_KEY", "aggregate", "run_columns", "visible_update_fraction",
           "write_report"]

VISIBLE_KEY = "visible_update_frac"

Runs = Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]]


def _series(rl: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rl if r.get(key) is not None]


def _mean(v: Sequence[float]) -> float | None:
    return sum(v) / len(v) if v else None


def _early(key: str) -> Callable[[Sequence[Mapping[str, Any]]], float | None]:
    return lambda rl: _mean(_series(rl[: max(1, len(rl) // 2)], key))


def _acc(which: str) -> Callable[[Sequence[Mapping[str, Any]]], float | None]:
    def f(rl: Sequence[Mapping[str, Any]]) -> float | None:
        acc = _series(rl, "accuracy")
        if len(acc) < 2:
            return None
        return getattr(window_change(acc, WINDOW), which)
    return f


COLUMNS: tuple[tuple[str, Callable[[Sequence[Mapping[str, Any]]], float | None]], ...] = (
    (f"acc first {WINDOW}", _acc("first")),
    (f"acc last {WINDOW}", _acc("last")),
    ("acc change", _acc("change")),
    ("mismatch KL", lambda rl: _mean(_series(rl, "mismatch_kl"))),
    ("max ratio", lambda rl: max(_series(rl, "prox_behav_ratio_max"), default=None)),
    ("TIS-truncated tokens", lambda rl: _mean(_series(rl, "tis_trunc_frac"))),
    ("clip fraction", lambda rl: _mean(_series(rl, "clip_frac"))),
    ("early rollout NLL", _early("rollout_nll")),
    ("early entropy", _early("entropy")),
    ("visible updates", lambda rl: _mean(_series(rl, VISIBLE_KEY))),
)
"""(title, value of one run's RL records)."""


def visible_update_fraction(before: Mapping[str, Any], after: Mapping[str, Any],
                            spec: Any) -> float | None:
    """Of the elements of the Megatron linear weights (``*linear_*.weight``, 2-D) that differ
    between the state dicts ``before`` and ``after``, the fraction whose rollout value
    ``spec.quantize_dequantize`` differs too (per Megatron tensor: per-row formats see the
    HF rows; two-level formats see one amax per fused tensor). None when nothing moved.

    QuRL (eq. 10-12): an update smaller than half the rounding step is invisible to the
    rollout engine; UAQ shrinks the step by s so more of the update survives.
    """
    import torch

    moved = visible = 0
    for name, w0 in before.items():
        if ".linear_" not in name or not name.endswith(".weight") or w0.dim() != 2:
            continue
        w0, w1 = w0.float(), after[name].float()
        diff = w0 != w1
        q_diff = spec.quantize_dequantize(w0) != spec.quantize_dequantize(w1)
        moved += int(diff.sum())
        visible += int(torch.logical_and(diff, q_diff).sum())
    return visible / moved if moved else None


def _rl(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("phase") == "rl"]


def run_columns(records: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """``{column title: value}`` of one run (see the module docstring)."""
    rl = _rl(records)
    return {title: fn(rl) for title, fn in COLUMNS}


def aggregate(runs: Runs) -> dict[str, dict[str, tuple[float, float, int] | None]]:
    """``{variant: {column: (mean, std, n seeds)}}``; None where no seed has a value."""
    out: dict[str, dict[str, tuple[float, float, int] | None]] = {}
    for label, by_seed in runs.items():
        cols = [run_columns(recs) for recs in by_seed.values()]
        out[label] = {}
        for title, _ in COLUMNS:
            vals = [c[title] for c in cols if c[title] is not None]
            out[label][title] = (*mean_std(vals), len(vals)) if vals else None
    return out


def _fmt(v: tuple[float, float, int] | None) -> str:
    if v is None:
        return "n/a"
    m, s, n = v
    return f"{m:.4g}" if n == 1 else f"{m:.4g} ± {s:.2g}"


def table(runs: Runs) -> str:
    """Markdown: one row per variant (mean ± std over seeds), then the accuracy change of
    every run (one column per seed)."""
    agg = aggregate(runs)
    titles = [t for t, _ in COLUMNS]
    n_seeds = max(len(v) for v in runs.values())
    lines = [f"mean ± std over {n_seeds} seed(s); columns: megatron_qrl/rl/compare_report.py",
             "", "| variant | " + " | ".join(titles) + " |", "|---" * (len(titles) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(_fmt(cols[t]) for t in titles) + " |"
              for label, cols in agg.items()]
    seeds = sorted({s for v in runs.values() for s in v}, key=str)
    lines += ["", "accuracy change per seed (last minus first window):", "",
              "| variant | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "|---" * (len(seeds) + 1) + "|"]
    for label, by_seed in runs.items():
        row = [run_columns(by_seed[s])["acc change"] if s in by_seed else None for s in seeds]
        lines.append(f"| {label} | " + " | ".join("n/a" if v is None else f"{v:+.3f}"
                                                  for v in row) + " |")
    return "\n".join(lines) + "\n"


def _panel(ax: Any, runs: Runs, key: str, title: str, log_y: bool = False) -> None:
    for label, by_seed in runs.items():
        curves = [rolling_mean(_series(_rl(recs), key)) for recs in by_seed.values()]
        curves = [c for c in curves if c]
        if not curves:
            continue
        mean, std = band(curves)
        x = list(range(len(mean)))
        line, = ax.plot(x, mean, linewidth=1, label=label)
        if len(curves) > 1:
            ax.fill_between(x, [max(m - s, 1e-12 if log_y else -1e9) for m, s in zip(mean, std)],
                            [m + s for m, s in zip(mean, std)], color=line.get_color(),
                            alpha=0.15, linewidth=0)
    if log_y:
        ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylabel(title)
    ax.grid(alpha=0.3)


def write_report(runs: Runs, out_dir: str | Path, name: str = "compare") -> tuple[Path, Path]:
    """Write ``<name>.md`` (:func:`table`) and ``<name>.png`` (curves with bands)."""
    if not runs or not all(runs.values()):
        raise ValueError("compare report: no runs given (every variant needs >= 1 seed)")
    out = Path(out_dir)
    md = atomic_write_text(out / f"{name}.md", table(runs))
    fig, axes = new_figure(3, 1, figsize=(9, 11), sharex=True)
    _panel(axes[0], runs, "accuracy", f"accuracy ({WINDOW}-step mean; ± std over seeds)")
    _panel(axes[1], runs, "rollout_nll", "rollout NLL (entropy est.)")
    _panel(axes[2], runs, "mismatch_kl", "KL(behav || prox)", log_y=True)
    axes[0].legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("RL step")
    return md, save_png(fig, out / f"{name}.png", dpi=100, bbox_inches="tight")
