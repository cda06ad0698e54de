"""2 GPUs (nvidia-h200-x2): SGLang engines of TP 2 and a fleet of one engine per GPU.

    bash bench/h200.sh mg-engine       # Ray from ray-part / ray-install for the qrl-train cases
    python -m pytest -q -s -rs tests/gpu/test_multigpu_sglang.py

* ``test_engine_tp2_inplace_matches_reference``: tests/gpu/test_sglang_inplace.py's worker with
  an engine of ``tp_size`` 2 (GPUs 0-1; the trainer's tensors on GPU 0): syncs weights A then
  B in place (both scheduler processes load every bucket and write a receipt) and generates;
  B's tokens are teacher-forced through the aligned reference with that file's limits. fp8
  and int8 (per-channel scales: the tiny MoE's expert width 128 splits into 64 per rank,
  which fp8_block's 128-blocks and the Marlin formats' 128-groups cannot).
* ``test_qrl_train_colocated_fleet``: ``qrl-train --qrl-mode colocated --qrl-rollout-engine
  sglang`` on the built-in tiny Qwen3-MoE, 2 RL steps, in two layouts: ``engine-tp2`` (one
  trainer process, one engine of ``--qrl-rollout-engine-tp 2`` over both GPUs, BF16
  rollouts) and ``ep2-fleet2`` (``torchrun --nproc-per-node 2``, trainer EP 2, two engines of
  TP 1, one per GPU: the 8-GPU run of examples/run_qwen3_30b_a3b.sh in miniature). Every RL
  record must show each engine's tokens and no restart; the step split is printed.

Skips with the reason on fewer than 2 GPUs or without SGLang (and Ray, for the qrl-train cases).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.compat.distributed import free_port
from tests.gpu import run_json_worker, skip_unless_sglang_gpu
from tests.helpers.multigpu_runs import LAYOUTS, STEPS, launcher, qrl_args

skip_unless_sglang_gpu("multi-GPU SGLang tests")
if torch.cuda.device_count() < 2:
    pytest.skip(f"{torch.cuda.device_count()} CUDA device(s): engine TP 2 and one engine per GPU "
                "need 2 (nvidia-h200-x2: bash bench/h200.sh mg-engine)", allow_module_level=True)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_engine_tp2_inplace_matches_reference(tmp_path, fmt):
    sys.path.insert(0, str(HERE))
    import test_sglang_inplace as inplace

    out = tmp_path / f"{fmt}-tp2.json"
    res = run_json_worker(inplace.__file__, [fmt, str(out), "inplace+tp2"], out, "out_b",
                          f"{fmt}: the TP 2 in-place sync worker")
    inplace.check_synced_engine(fmt, res, "inplace+tp2")


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_qrl_train_colocated_fleet(tmp_path, layout):
    pytest.importorskip("ray", reason="Ray is not in the H200 site: ray-part 1..2, ray-install")
    out = tmp_path / layout
    cmd = [*launcher(layout, free_port()), *qrl_args(layout, str(out))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(),
                          cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    rl = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
          if r.get("phase") == "rl"]
    assert len(rl) == STEPS, [r.get("phase") for r in rl]
    engines = LAYOUTS[layout][1]
    for r in rl:
        print(f"[mg-engine] {layout} step {r['step']}: " + ", ".join(
            f"{k} {r.get(k)}" for k in ("time_rollout_s", "time_recompute_s", "time_train_s",
                                        "time_sync_s", "reward_mean", "mismatch_kl")
            + tuple(f"fleet/engine{i}_tokens_per_s" for i in range(engines))), flush=True)
        for i in range(engines):
            assert r[f"fleet/engine{i}_tokens"] > 0 and r[f"fleet/engine{i}_restarts"] == 0, (
                layout, i, {k: v for k, v in r.items() if k.startswith("fleet/")})
