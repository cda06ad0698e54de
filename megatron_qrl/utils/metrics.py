"""Per-step metrics: ``<output-dir>/metrics.jsonl``, TensorBoard, a final PNG, a compare table.

Every step appends ONE JSON object (one write of its whole line, fsync'ed) holding at least
:data:`REQUIRED_KEYS`. ``mismatch_kl`` is the k3 estimate of KL(pi_behav || pi_prox) on rollout
tokens (losses metric ``kl_behav_prox_k3``); ``clip_frac`` the fraction of tokens clipped
(low + high); ``time_*_s`` wall seconds of the step's phases. SFT steps have no rollout:
RL-only values may be ``None`` (``null``). Extra keys are kept (e.g. the losses' metrics,
``prox_behav_ratio_max`` which the compare table reads, ``time_recompute_s``).

TensorBoard (``torch.utils.tensorboard``, needs the ``tensorboard`` package: the ``test``
extra pins it): every numeric value of a record is a scalar with tag = the metric's key and
global step = the record's ``step``, written to ``<output-dir>/tensorboard`` (or
``tensorboard_dir``), flushed after each step. Without the package one line is logged (once
per process) and the run goes on. A resumed logger (``resume_from_step=k``) opens its writer
with ``purge_step=k``: TensorBoard hides the first run's events at steps >= k, so every step
shows once (the first run's event file stays on disk, like the rewritten metrics.jsonl lines).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .io import atomic_write_text
from .plots import new_figure, save_png

__all__ = [
    "COMPARE_COLUMNS",
    "METRICS_FILE",
    "PHASES",
    "REQUIRED_KEYS",
    "MetricsLogger",
    "compare_runs",
    "plot_run",
    "read_metrics",
    "sft_panel_points",
    "summarize_run",
]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PHASES = ("sft", "rl")
REQUIRED_KEYS = ("step", "phase", "reward_mean", "mismatch_kl", "clip_frac", "error_token_rate",
                 "time_rollout_s", "time_train_s", "time_sync_s")
PLOT_KEYS = (("reward_mean", "reward"), ("mismatch_kl", "KL(behav || prox)"),
             ("clip_frac", "clip fraction"))
COMPARE_COLUMNS = (
    ("final reward", "reward_mean", "last"),
    ("mean KL(behav||prox)", "mismatch_kl", "mean"),
    ("max ratio prox/behav", "prox_behav_ratio_max", "max"),
    ("clip fraction", "clip_frac", "mean"),
    ("error-token rate", "error_token_rate", "mean"),
)
"""(column title, metrics key, reduction over the RL steps). ``last`` = mean over the last
``final_window`` RL steps (one step is noisy)."""


def _scalar(key: str, value: Any) -> float | int | str | bool | None:
    if value is None or isinstance(value, (str, bool)):
        return value
    if hasattr(value, "item"):  # torch / numpy scalars
        value = value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(float(value)):
            raise ValueError(f"metrics: {key}={value} is not finite (log None when undefined)")
        return float(value)
    raise TypeError(f"metrics: {key} has type {type(value).__name__}; log numbers or strings")


def validate_record(record: Mapping[str, Any], last_step: int | None = None) -> dict[str, Any]:
    """A JSON-ready copy of ``record``, or an error naming the bad key."""
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise ValueError(f"metrics: record lacks required key(s) {', '.join(missing)}")
    out = {str(k): _scalar(str(k), v) for k, v in record.items()}
    step = out["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"metrics: step must be an integer >= 0, got {record['step']!r}")
    if last_step is not None and step <= last_step:
        raise ValueError(f"metrics: step {step} is not after the last logged step {last_step}")
    if out["phase"] not in PHASES:
        raise ValueError(f"metrics: phase must be one of {PHASES}, got {out['phase']!r}")
    for k in REQUIRED_KEYS[2:]:
        if out[k] is not None and (isinstance(out[k], bool) or not isinstance(out[k], (int, float))):
            raise ValueError(f"metrics: {k} must be a number or None, got {out[k]!r}")
    return out


def read_metrics(path: str | Path,
                 warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (or of the directory holding it).

    A torn last line (no newline at its end and not valid JSON: a write cut short by a full
    disk or a crash) is dropped with a warning through ``warn`` (default: this module's
    logger); an invalid line anywhere else is an error naming the file and line.
    """
    p = Path(path)
    p = p / METRICS_FILE if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"metrics: {p} not found")
    text = p.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    out = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if lineno == len(lines):  # the last line has no newline: a torn write
                (warn or log.warning)(f"metrics: {p} line {lineno} is a torn record "
                                      f"({len(line)} bytes, cut short); dropped")
                break
            raise ValueError(f"metrics: {p} line {lineno}: invalid JSON ({exc.msg})") from None
    return out


class MetricsLogger:
    """Append validated per-step records to ``<output_dir>/metrics.jsonl`` (+ TensorBoard).

    ``resume_from_step=k`` keeps the records with ``step < k`` already in the file (a resumed
    run rewrites the steps after its checkpoint; a torn last line is dropped, said through
    ``warn``); otherwise an existing non-empty file is an error unless ``overwrite``.
    ``tensorboard``: also write TensorBoard scalars (when the package is installed) to
    ``tensorboard_dir`` (None: ``<output_dir>/tensorboard``).

    Each record is ONE ``os.write`` of its whole line to the file opened ``O_APPEND``, then
    ``fsync``; a short write (a full disk) is cut back to the previous end of the file before
    the error is raised, so the file never holds a torn line written by this logger.
    """

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, overwrite: bool = False,
                 resume_from_step: int | None = None,
                 tensorboard_dir: str | Path | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / METRICS_FILE
        kept: list[dict[str, Any]] = []
        if resume_from_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path, warn) if r["step"] < resume_from_step]
        elif self.path.exists() and self.path.stat().st_size and not overwrite:
            raise FileExistsError(f"{self.path} exists: resume the run (--qrl-resume) or choose "
                                  "another --qrl-output-dir")
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.records = kept
        self._tb_wanted = tensorboard
        self.tensorboard_dir = Path(tensorboard_dir or self.dir / TENSORBOARD_DIR)
        self._purge_step = resume_from_step
        self._tb: Any = None
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    @property
    def last_step(self) -> int | None:
        return self.records[-1]["step"] if self.records else None

    def log(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Validate, append and flush one step's record; returns the stored copy."""
        clean = validate_record(record, self.last_step)
        self._append((json.dumps(clean) + "\n").encode("utf-8"))
        self.records.append(clean)
        self._tensorboard(clean)
        return clean

    def _append(self, line: bytes) -> None:
        """One whole line, durably, or nothing (class docstring)."""
        if self._fd is None:
            raise ValueError(f"metrics: {self.path} is closed")
        end = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(28, f"wrote {written} of {len(line)} bytes (no space left on "
                                  "device?)", str(self.path))
            os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            raise

    def _tensorboard(self, rec: Mapping[str, Any]) -> None:
        if not self._tb_wanted:
            return
        if self._tb is None:
            self._tb = _summary_writer(self.tensorboard_dir, self._purge_step)
            if self._tb is None:
                self._tb_wanted = False
                return
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._tb.add_scalar(k, v, rec["step"])
        self._tb.flush()

    def close(self, plot: bool = True) -> Path | None:
        """Close the files; write ``metrics.png`` (:func:`plot_run`) when ``plot``."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tb is not None:
            self._tb.close()
        return plot_run(self.records, self.dir / "metrics.png") if plot and self.records else None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            self.close(plot=exc[0] is None)


_TB_MISSING_LOGGED = False


def _summary_writer(log_dir: Path, purge_step: int | None) -> Any:
    """A ``SummaryWriter`` on ``log_dir``, or None (logged once) without ``tensorboard``."""
    global _TB_MISSING_LOGGED
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        if not _TB_MISSING_LOGGED:
            _TB_MISSING_LOGGED = True
            log.warning("metrics: no TensorBoard scalars (%s); `pip install tensorboard` to "
                        "get them, metrics.jsonl is written either way", exc)
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _save_png(fig: Any, path: Path) -> Path:
    return save_png(fig, path, dpi=100, bbox_inches="tight")


def sft_panel_points(records: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, float]]]:
    """``(label, [(step, value)])`` of the SFT phase for the first panel: its rewards when
    SFT steps log ``reward_mean``, else its ``sft_loss``."""
    sft = [r for r in records if r.get("phase") == "sft"]
    rewards = [(r["step"], r["reward_mean"]) for r in sft if r.get("reward_mean") is not None]
    if rewards:
        return "SFT reward", rewards
    return "SFT loss", [(r["step"], r["sft_loss"]) for r in sft if r.get("sft_loss") is not None]


def plot_run(records: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """PNG with reward, mismatch KL and clip fraction against step (SFT steps shaded; the
    first panel shows the SFT loss on a right-hand axis, see :func:`sft_panel_points`)."""
    fig, axes = new_figure(len(PLOT_KEYS), 1, figsize=(7, 7), sharex=True)
    sft = [r["step"] for r in records if r["phase"] == "sft"]
    for ax, (key, title) in zip(axes, PLOT_KEYS):
        pts = [(r["step"], r[key]) for r in records
               if r.get(key) is not None and not (ax is axes[0] and r["phase"] == "sft")]
        if pts:
            ax.plot(*zip(*pts), marker=".", linewidth=1)
        if sft:
            ax.axvspan(min(sft), max(sft), color="0.9", label="sft")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    label, sft_pts = sft_panel_points(records)
    if sft_pts:
        twin = axes[0] if label == "SFT reward" else axes[0].twinx()
        twin.plot(*zip(*sft_pts), marker=".", linewidth=1, color="tab:orange", label=label)
        twin.legend(loc="upper left", fontsize=8)
        if twin is not axes[0]:
            twin.set_ylabel(label)
    axes[-1].set_xlabel("step")
    return _save_png(fig, Path(path))


def summarize_run(records: Sequence[Mapping[str, Any]], final_window: int = 5) -> dict[str, float | None]:
    """``{column title: value}`` over the RL steps (see :data:`COMPARE_COLUMNS`)."""
    rl = [r for r in records if r.get("phase") == "rl"]
    out: dict[str, float | None] = {}
    for title, key, how in COMPARE_COLUMNS:
        vals = [float(r[key]) for r in rl if r.get(key) is not None]
        if how == "last":
            vals = vals[-final_window:]
        if not vals:
            out[title] = None
        else:
            out[title] = max(vals) if how == "max" else sum(vals) / len(vals)
    return out


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def compare_runs(runs: Mapping[str, Sequence[Mapping[str, Any]] | str | Path], out_dir: str | Path,
                 final_window: int = 5, name: str = "compare") -> tuple[Path, Path]:
    """Write ``<name>.md`` (one row per run) and ``<name>.png`` (one bar panel per column).

    ``runs`` maps a run label to its records or its output directory / metrics file.
    """
    if not runs:
        raise ValueError("compare_runs: no runs given")
    summaries = {label: summarize_run(v if isinstance(v, Sequence) and not isinstance(v, str)
                                      else read_metrics(v), final_window)
                 for label, v in runs.items()}
    titles = [c[0] for c in COMPARE_COLUMNS]
    lines = ["| run | " + " | ".join(titles) + " |", "|---" * (len(titles) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(_fmt(s[t]) for t in titles) + " |"
              for label, s in summaries.items()]
    out = Path(out_dir)
    md = atomic_write_text(out / f"{name}.md", "\n".join(lines) + "\n")
    fig, axes = new_figure(1, len(titles), figsize=(4 * len(titles), 4))
    labels = list(summaries)
    for ax, title in zip(axes, titles):
        ax.bar(range(len(labels)), [summaries[lb][title] or 0.0 for lb in labels])
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    return md, _save_png(fig, out / f"{name}.png")
