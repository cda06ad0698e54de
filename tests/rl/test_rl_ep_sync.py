"""qrl-train under torchrun, trainer EP = 2 (gloo), a fleet of 2 reference engines in Ray actors.

Every EP rank sends its own experts to the engines (``megatron_qrl.rl.ep_sync``): the run
must equal the same job on the gathering sync (``--gather-experts`` in the test helper)
record for record (batches, rewards, losses, grad norms; engine fingerprints are verified
against the combined manifests in every sync), rank 0 must all-gather 0 bytes over the EP
group in its weight streams (the gathering path: every expert of rank 1), and rank 1 must
send its experts itself. An engine killed before the 2nd rollout is restarted and re-synced
from both senders (new groups for the new membership), and the run is still the same.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_qrl.compat.distributed import free_port
from megatron_qrl.data import CharTokenizer
from tests.helpers import HELPERS
from tests.helpers.tiny_hf import make_tiny_hf

ROOT = Path(__file__).resolve().parents[2]
HELPER = HELPERS / "rl_ray_helper.py"
JOB = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "0", "--qrl-steps", "2",
       "--qrl-prompts-per-step", "2", "--qrl-rollout-n-samples-per-prompt", "2",
       "--qrl-rollout-max-new-tokens", "3", "--qrl-micro-batch-size", "2",
       "--qrl-updates-per-step", "1", "--qrl-save-interval", "0", "--qrl-no-progress",
       "--qrl-mode", "colocated", "--qrl-rollout-num-engines", "2"]


def _records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith(("time_", "fleet/"))}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(tmp: Path, hf: Path, address: str, *extra: str) -> tuple[list[dict], dict, list[dict]]:
    out, log = tmp / "out", tmp / "log"
    log.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RAY_ADDRESS=address)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(HELPER),
           *JOB, *extra, "--ep-log", str(log), "--qrl-output-dir", str(out),
           "--", "--load", str(hf), "--expert-model-parallel-size", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if "Error" in line][-20:]
    assert proc.returncode == 0, "\n".join(errors) + proc.stdout[-2000:] + proc.stderr[-3000:]
    logs = {r: json.loads((log / f"rank{r}.json").read_text()) for r in (0, 1)}
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return _records(out), logs, raw


def ray_runs(tmp: Path, **runs: tuple[str, ...]) -> dict[str, tuple[list[dict], dict, list[dict]]]:
    """Each ``name=(extra args)`` job of :func:`_run`, in order, on the tiny MoE checkpoint
    against one local Ray cluster."""
    ray = pytest.importorskip("ray")
    hf = make_tiny_hf(tmp / "hf", "moe")
    CharTokenizer().save(hf, hf=False)
    ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        address = ctx.address_info["gcs_address"]
        return {name: _run(tmp / name, hf, address, *extra) for name, extra in runs.items()}
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ep2_ranks_send_their_own_experts_and_match_the_gathering_sync(tmp_path):
    res = ray_runs(tmp_path, gather=("--gather-experts",), sharded=("--kill", "generate:3"))
    (gathered, glog, _), (sharded, slog, raw) = res["gather"], res["sharded"]
    assert [r["phase"] for r in gathered] == ["rl", "rl"]
    assert sharded == gathered  # same batches, rewards, losses, grad norms, bit for bit
    # the gathering sync pulls rank 1's experts onto rank 0; the sharded one pulls nothing
    assert glog[0]["ep_gather_bytes"] > 0 and glog[0]["sharded_sends"] == 0
    assert slog[0]["ep_gather_bytes"] == 0 and slog[1]["ep_gather_bytes"] == 0
    # rank 1 sent its own experts: the initial sync, the re-sync of the restarted engine,
    # and the syncs after the 2 steps (rank 0's sends go through the fleet's groups)
    assert slog[1]["sharded_sends"] == 4
    assert sum(v for k, v in raw[-1].items() if k.endswith("_restarts")) == 1
    print(f"\nEP=2 qrl-train: rank 0 all-gathered {glog[0]['ep_gather_bytes']} B of experts "
          f"over EP (gathering sync) vs {slog[0]['ep_gather_bytes']} B (sharded)")


@pytest.mark.parametrize("ep, lora, shardable, expect", [
    (2, False, True, True),
    (1, False, True, False),    # no expert parallelism: nothing to shard
    (2, True, True, False),     # LoRA sends the base once, then adapters (its own path)
    (2, False, False, False),   # SGLang engines in the actors: the gathering sync
    (None, False, True, False),  # one process
])
def test_the_one_rule(monkeypatch, ep, lora, shardable, expect):
    import torch.distributed as dist

    from megatron_qrl.models.streaming import ShardGroups
    from megatron_qrl.rl.ep_sync import sharded_sync_applies
    from megatron_qrl.rollout.transports.fleet import FleetBroadcast

    group = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: ep)

    class Fleet:
        broadcast = FleetBroadcast(shardable=shardable)

    groups = ShardGroups(ep=group) if ep is not None else None
    assert sharded_sync_applies(Fleet(), groups, lora) is expect
    assert sharded_sync_applies(object(), groups, lora) is False  # one engine actor / objectstore
