"""qrl-train under torchrun, trainer EP = 2 (gloo), a fleet of 2 reference engines in Ray actors
(colocated): the jobs of tests/rl/test_rl_ep_sync.py and test_rl_ep_sync_death.py, each run once
per worker and shared (the ``ep2_ray_runs`` fixture of tests/rl/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_qrl.compat.distributed import free_port
from megatron_qrl.data import CharTokenizer
from tests.helpers import HELPERS, REPO
from tests.helpers.tiny_hf import make_tiny_hf

JOB = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "0", "--qrl-steps", "2",
       "--qrl-prompts-per-step", "2", "--qrl-rollout-n-samples-per-prompt", "2",
       "--qrl-rollout-max-new-tokens", "3", "--qrl-micro-batch-size", "2",
       "--qrl-updates-per-step", "1", "--qrl-save-interval", "0", "--qrl-no-progress",
       "--qrl-mode", "colocated", "--qrl-rollout-num-engines", "2"]
RUNS = {
    "gather": ("--gather-experts",),  # the gathering sync: rank 0 sends every expert
    "sharded": ("--kill", "generate:3"),  # each EP rank sends its own; an engine killed
    "died": ("--exit-in-sharded-update", "2"),  # an engine exits mid-way through a sync
}
"""Each job's extra arguments to tests/helpers/rl_ray_helper.py."""

Run = tuple[list[dict], dict, list[dict]]
"""(records without timings / per-engine counters, ``{rank: --ep-log}``, raw records)."""


def _records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith(("time_", "fleet/"))}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_ep2(tmp: Path, hf: Path, address: str, *extra: str) -> Run:
    """One job on the tiny MoE checkpoint ``hf`` against the Ray cluster at ``address``."""
    out, log = tmp / "out", tmp / "log"
    log.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), RAY_ADDRESS=address)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(HELPERS / "rl_ray_helper.py"), *JOB, *extra, "--ep-log", str(log),
           "--qrl-output-dir", str(out), "--", "--load", str(hf),
           "--expert-model-parallel-size", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    errors = [line for line in proc.stderr.splitlines() if "Error" in line][-20:]
    assert proc.returncode == 0, "\n".join(errors) + proc.stdout[-2000:] + proc.stderr[-3000:]
    logs = {r: json.loads((log / f"rank{r}.json").read_text()) for r in (0, 1)}
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return _records(out), logs, raw


class EP2Runs:
    """The :data:`RUNS` jobs, each run on first request and kept (a job takes 1-3 min here)."""

    def __init__(self, tmp: Path, address):
        self.tmp, self.address, self.done = tmp, address, {}
        self.hf: Path | None = None

    def __call__(self, *names: str) -> dict[str, Run]:
        if self.hf is None:
            self.hf = make_tiny_hf(self.tmp / "hf", "moe")
            CharTokenizer().save(self.hf, hf=False)
        for name in names:
            if name not in self.done:
                self.done[name] = run_ep2(self.tmp / name, self.hf, self.address(), *RUNS[name])
        return {name: self.done[name] for name in names}
