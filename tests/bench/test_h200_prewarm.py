"""bench/h200.sh's Marlin prewarm: the setup call carries no stand-in IPython (.stage/stub,
over the device's 64 MiB limit beside .stage/s1), without which the prewarm's sglang import
fails, so setup asks and the first phase that carries the stub starts it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STATE = [Path("/tmp/prewarm.asked"), Path("/tmp/prewarm.pid"), Path("/tmp/prewarm.log")]


@pytest.fixture
def device_copy(tmp_path):
    """A stand-in of the device's checkout: the script, an empty recipe, a prewarm that
    records that it ran, a fake nvidia-smi."""
    (tmp_path / "bench").mkdir()
    shutil.copy(REPO / "bench" / "h200.sh", tmp_path / "bench" / "h200.sh")
    (tmp_path / ".stage" / "recipe").mkdir(parents=True)
    (tmp_path / ".stage" / "recipe" / "setup.sh").write_text("export PYTHONPATH=\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "prewarm_sglang_kernels.py").write_text(
        "from pathlib import Path\nPath('prewarm.ran').write_text('ran')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'name, memory.used [MiB]'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    for f in STATE:
        f.unlink(missing_ok=True)
    yield tmp_path
    for f in STATE:
        f.unlink(missing_ok=True)


def _phase(root: Path, phase: str) -> str:
    env = {**os.environ, "PATH": f"{root / 'bin'}:{os.environ['PATH']}",
           "OUT": str(root / "out")}
    return subprocess.run(["bash", "bench/h200.sh", phase], cwd=root, env=env, text=True,
                          capture_output=True, timeout=60).stdout


def test_setup_without_the_stub_asks_and_the_next_phase_with_it_starts_the_prewarm(device_copy):
    """Catches: the prewarm started by a setup that has no stub (on the H200 every kernel
    then failed at its import: "No module named 'IPython'", and w4a16 phases compiled in their
    own engine's start instead), or never started after."""
    said = _phase(device_copy, "setup")
    assert "starts with the next phase that carries .stage/stub" in said
    assert STATE[0].exists() and not STATE[1].exists()
    time.sleep(0.5)
    assert not (device_copy / "prewarm.ran").exists()
    (device_copy / ".stage" / "stub" / "IPython").mkdir(parents=True)
    said = _phase(device_copy, "no-such-phase")  # any phase: the script's prelude starts it
    assert "Marlin prewarm started (asked by setup)" in said
    assert not STATE[0].exists() and STATE[1].exists()
    for _ in range(100):
        if (device_copy / "prewarm.ran").exists():
            break
        time.sleep(0.1)
    assert (device_copy / "prewarm.ran").read_text() == "ran"
    assert "Marlin prewarm started" not in _phase(device_copy, "no-such-phase")  # once


def test_setup_with_the_stub_starts_the_prewarm_at_once(device_copy):
    (device_copy / ".stage" / "stub" / "IPython").mkdir(parents=True)
    said = _phase(device_copy, "setup")
    assert "next phase" not in said and STATE[1].exists() and not STATE[0].exists()
