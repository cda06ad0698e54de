#!/usr/bin/env python3
"""Summary of a multi-GPU qrl-train run (bench/h200.sh mg-30b): each RL step's split
(rollout / recompute / train / sync seconds, rank 0's trainer peak) and each GPU's peak memory
from an ``nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms
1000`` log taken during the run (engines + trainer together: what the device really held).

    python bench/multigpu_summary.py --metrics RUN/metrics.jsonl --gpu-log mem.csv \
        --out summary.json

No GPU needed; prints one line per step, one per GPU, and writes the JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.rl_step import PHASES  # noqa: E402

STEP_KEYS = (*PHASES, "trainer_peak_gib", "trainer_reserved_gib", "alloc_retries")


def gpu_peaks(lines: list[str]) -> dict[int, float]:
    """``{gpu index: peak memory.used (GiB)}`` of the nvidia-smi CSV lines (timestamp, index,
    MiB); lines that are not such a row (a header, a cut last line) are skipped."""
    peaks: dict[int, float] = {}
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        try:
            mib = float(parts[2])
        except ValueError:
            continue
        gpu = int(parts[1])
        peaks[gpu] = max(peaks.get(gpu, 0.0), mib / 1024)
    return dict(sorted(peaks.items()))


def step_split(records: list[dict]) -> list[dict]:
    """The RL records' step, phase seconds, share of the step per phase and trainer memory."""
    out = []
    for r in records:
        if r.get("phase", "rl") != "rl":
            continue
        row = {"step": r.get("step")} | {k: r.get(k) for k in STEP_KEYS}
        total = sum(r.get(k) or 0.0 for k in PHASES)
        row["step_s"] = round(total, 3)
        row["share"] = {k: round((r.get(k) or 0.0) / total, 3) for k in PHASES} if total else None
        out.append(row)
    return out


def summary(records: list[dict], gpu_lines: list[str]) -> dict:
    return {"steps": step_split(records), "gpu_peak_gib": gpu_peaks(gpu_lines)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--metrics", type=Path, required=True, help="the run's metrics.jsonl")
    p.add_argument("--gpu-log", type=Path, default=None, help="nvidia-smi CSV log")
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    a = p.parse_args(argv)
    records = ([json.loads(ln) for ln in a.metrics.read_text().splitlines() if ln.strip()]
               if a.metrics.is_file() else [])
    gpu = a.gpu_log.read_text().splitlines() if a.gpu_log and a.gpu_log.is_file() else []
    s = summary(records, gpu)
    for row in s["steps"]:
        print("[mg-summary] step " + json.dumps(row))
    for i, gib in s["gpu_peak_gib"].items():
        print(f"[mg-summary] GPU {i} peak {gib:.1f} GiB")
    if not s["steps"]:
        print(f"[mg-summary] no RL record in {a.metrics}")
    if a.out is not None:
        a.out.write_text(json.dumps(s, indent=1) + "\n")
    return 0 if s["steps"] else 1


if __name__ == "__main__":
    sys.exit(main())
