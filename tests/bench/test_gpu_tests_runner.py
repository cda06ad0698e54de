"""``bench/h200.sh gpu-tests`` keeps the evidence of a run cut short: with ``QRL_PRINT_FAILURES``
set, tests/conftest.py writes each failure (traceback and printed output) to stderr the moment
it fails, not only in the summary at the end; without it nothing extra is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, env_value: str | None) -> subprocess.CompletedProcess:
    test = tmp_path / "test_cut.py"
    test.write_text("def test_fails():\n    print('measured 1.5')\n    assert 1 == 2\n\n"
                    "def test_passes():\n    pass\n")
    env = {k: v for k, v in os.environ.items()  # (run from an xdist worker: not one itself)
           if k != "QRL_PRINT_FAILURES" and not k.startswith("PYTEST_XDIST")}
    if env_value is not None:
        env["QRL_PRINT_FAILURES"] = env_value
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         "-p", "tests.conftest", "--tb=short", str(test)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_failures_written_as_they_happen(tmp_path):
    run = _run(tmp_path, "1")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "== FAILED " in run.stderr and "test_cut.py::test_fails (call) ==" in run.stderr
    assert "assert 1 == 2" in run.stderr and "measured 1.5" in run.stderr
    assert "test_passes" not in run.stderr


def test_nothing_extra_without_the_variable(tmp_path):
    run = _run(tmp_path, None)
    assert run.returncode == 1 and "== FAILED " not in run.stderr
