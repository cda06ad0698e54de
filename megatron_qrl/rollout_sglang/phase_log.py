"""Where an in-place sync's engine-side time goes: per-bucket phase times, opt-in.

Set ``QRL_INPLACE_PROFILE=/path/file.jsonl`` in the environment the SGLang engine starts in
(its scheduler processes inherit it). Every bucket the in-place loader applies then appends
one JSON line ``{"pid", "begin", "final", "tensors", "done", "<phase>_s": ...}``; each phase
is timed between device synchronizations, so the numbers add up to the bucket's wall time
(and the synchronizations cost a little: leave it unset outside measurements).
:func:`summarize` folds a file into one row per sync.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

PROFILE_ENV = "QRL_INPLACE_PROFILE"


class PhaseLog:
    """Phase timer of one bucket; a no-op unless :data:`PROFILE_ENV` names a file."""

    def __init__(self) -> None:
        self.path = os.environ.get(PROFILE_ENV) or None
        self.phases: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        """Counters written with the bucket's line (e.g. direct expert loads batched)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.path is None:
            yield
            return
        _sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            key = f"{name}_s"
            self.phases[key] = self.phases.get(key, 0.0) + time.perf_counter() - t0

    def write(self, msg: dict, n_tensors: int) -> None:
        if self.path is None:
            return
        rec = {"pid": os.getpid(), "begin": bool(msg.get("begin")), "final": bool(msg.get("final")),
               "tensors": n_tensors, "done": len(msg.get("done", {})), **self.counts, **self.phases}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def summarize(path: str | Path) -> list[dict]:
    """One row per sync of one engine process (``begin`` .. ``final``): summed phase times,
    buckets, tensors and direct expert-load counters, in file order."""
    rows: list[dict] = []
    open_rows: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        row = open_rows.get(rec["pid"])
        if rec["begin"] or row is None:
            row = open_rows[rec["pid"]] = {"pid": rec["pid"], "buckets": 0, "tensors": 0}
            rows.append(row)
        row["buckets"] += 1
        row["tensors"] += rec["tensors"]
        for k, v in rec.items():
            if k.endswith("_s") or k.startswith("experts"):  # phase times and load counters
                row[k] = row.get(k, 0 if isinstance(v, int) else 0.0) + v
        if rec["final"]:
            open_rows.pop(rec["pid"], None)
    for row in rows:
        row["total_s"] = sum(v for k, v in row.items() if k.endswith("_s"))
    return rows


if __name__ == "__main__":  # python -m megatron_qrl.rollout_sglang.phase_log FILE
    import sys

    for r in summarize(sys.argv[1]):
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
