"""Run each bench variant in a fresh Python process (fresh GPU memory, its own environment)
and collect the ``RESULT {json}`` line it prints."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def commit() -> str:
    """The checkout's commit: ``.commit`` at the repository root first (the device machine's
    copy of the tree may carry a stale git HEAD), else ``git rev-parse --short HEAD``."""
    root = Path(__file__).resolve().parents[1]
    marker = root / ".commit"
    if marker.is_file():
        return marker.read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def append_records(out: Path | None, records: list[dict]) -> None:
    """Append ``records`` to the JSONL file ``out`` (its folder made), if ``out`` is given."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def run_variant(argv: list[str], variant: str, out: Path | None = None,
                env: dict | None = None, tag: str = "bench", extra: dict | None = None) -> dict:
    """``python argv...``; its last ``RESULT`` record (or ``{"error": ...}``) plus ``extra``
    (run-wide fields) and the checkout's :func:`commit` (unless the child gave one), appended
    to ``out`` (JSONL) when given. The child's stderr tail is echoed on failure."""
    t = time.time()
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else {
        "variant": variant, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    res["total_s"] = round(time.time() - t, 1)
    res.update(extra or {})
    res.setdefault("commit", commit())
    print(f"[{tag}] {variant}: {json.dumps(res)}", flush=True)
    if "error" in res:
        sys.stderr.write(proc.stderr[-3000:])
    append_records(out, [res])
    return res


def child_main(run: Callable[[], dict]) -> int:
    """The child side: print one ``RESULT`` line."""
    print("RESULT " + json.dumps(run()), flush=True)
    return 0
