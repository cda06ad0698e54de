"""Plots survive a process where pyplot's backend resolution breaks (as in SGLang's
environment on the H200, whose stand-in ``IPython`` lacks ``get_ipython``: qrl-train lost its
plot there): every plot goes through megatron_qrl.utils.plots (no pyplot). (A stand-in
without ``version_info`` breaks even a bare ``Figure`` — matplotlib's canvas reads it — so
the H200 recipe's stub carries ``version_info``.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys, types
    ipy = sys.modules["IPython"] = types.ModuleType("IPython")  # a stand-in without
    ipy.version_info = (8, 24, 0)                                 # get_ipython
    import matplotlib.pyplot  # imported first, backend left to auto-resolve
    from megatron_qrl.utils.metrics import plot_run, compare_runs
    rec = [{"step": 0, "phase": "sft", "sft_loss": 2.0},
           {"step": 1, "phase": "rl", "reward_mean": 0.5, "mismatch_kl": 1e-3, "clip_frac": 0.1}]
    out = sys.argv[1]
    print(plot_run(rec, out + "/m.png").stat().st_size)
    print(compare_runs({"a": rec, "b": rec}, out)[1].stat().st_size)
""")


def test_plots_render_where_pyplot_backend_resolution_fails(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    sizes = [int(x) for x in r.stdout.split()]
    assert len(sizes) == 2 and min(sizes) > 1000
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
