"""Metrics records of finished ``qrl-train`` runs, compared step by step (shared by the
multi-rank and memory-flag tests; no tests here)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def read_records(out: Path) -> list[dict]:
    """The records of ``<out>/metrics.jsonl``."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_records_close(ref: list[dict], got: list[dict], keys: Sequence[str],
                         tol: float = 1e-5, skip_missing: bool = False) -> None:
    """Same steps; for each step and each of ``keys``, floats within ``tol`` (relative, at
    least absolute), anything else equal. ``skip_missing``: keys absent from the ``ref``
    record are not compared (otherwise a key absent from one record only fails)."""
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(ref, got):
        for key in keys:
            if skip_missing and key not in a:
                continue
            x, y = a.get(key), b.get(key)
            if isinstance(x, float) and isinstance(y, float):
                assert abs(x - y) <= tol * max(1.0, abs(x)), (a["step"], key, x, y)
            else:
                assert x == y, (a["step"], key, x, y)
