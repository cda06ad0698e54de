"""bench/path_census.py: an RL-step train micro batch against train_mfu's, op by op."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rl_step_micro_batch_runs_train_mfus_ops(tmp_path):
    """qrl-train in-process under the qwen3-30b-a3b preset as bench/rl_step.py starts it: a
    later update's micro batch runs train_mfu's ops but for the one ``detach`` of pi_prox
    (given, not this forward's own); the first update adds the routing-agreement metric and
    its one host read. Fails on a trainer that checks, moves and reorders the engine's expert
    ids in forwards that do not read them (7 host ops + 3 per micro batch before)."""
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/path_census.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["updates"] == 4 and rec["routing_first_update"]
    assert "routed_experts" in rec["rl_micro_batch"]  # the engine's ids are in the batch
    assert set(rec["op_diff_vs_train_mfu"]["rl later update"]) <= {"detach"}
    first = rec["rl first update"]["syncs"]
    assert sum("megatron_qrl/rl/trainer.py" in s for s in first) == 1  # the agreement read
