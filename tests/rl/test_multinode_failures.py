"""Two nodes simulated on this machine: each failure ends with ONE line on every node, in time.

Each node is its own ``torchrun --nnodes 2 --node-rank R --master-addr 127.0.0.1`` (one rank
per node, gloo); where Ray is needed the cluster has two raylets
(``ray.cluster_utils.Cluster``: a head and a worker node). Every test states its bound: the
seconds from the start of the nodes to the last one's exit, generous for a 2-core CI host.

* an engine node that leaves the Ray cluster during a fleet run with the EP-sharded sync: the
  fleet restarts the engine, its bundle cannot be placed again, rank 0 says so in one line
  (the bounded wait for the bundle) and rank 1 stops with rank 0's line (the sharded sync's
  messages in one place: a re-sync announced while rank 1 waits for a header);
* a placement that cannot fit: one line with the cluster's resources, no traceback;
* a rank that fails alone (resume on a node whose directory lacks the checkpoint): its own
  line, and the other node's line names the lost rank and quotes it;
* a frozen node: the other node's line after the collective timeout;
* colocated mode on a two-node Ray cluster: the engine's bundle is on the driver's node even
  where Ray's best fit is the other node.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megatron_qrl.data import CharTokenizer
from tests.helpers import HELPERS
from tests.helpers.tiny_hf import make_tiny_hf
from tests.helpers.two_nodes import ROOT, finish, start_nodes

RAY_HELPER = HELPERS / "rl_ray_helper.py"
TINY = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "0", "--qrl-prompts-per-step", "2",
        "--qrl-rollout-n-samples-per-prompt", "2", "--qrl-rollout-max-new-tokens", "3",
        "--qrl-micro-batch-size", "2", "--qrl-updates-per-step", "1", "--qrl-no-progress"]


def _one_line_each(nodes, *expected: str) -> None:
    """Every node exited non-zero with exactly one ``qrl-train: error:`` line, prefixed with
    its node / rank, containing ``expected[r]``; no traceback of ours."""
    for n, want in zip(nodes, expected):
        lines = n.errors()
        assert n.rc not in (None, 0), f"node {n.rank}: rc {n.rc}\n{n.stderr[-3000:]}"
        assert len(lines) == 1, f"node {n.rank}: {lines}\n{n.stderr[-3000:]}"
        assert lines[0].startswith(f"qrl-train: error: [node {n.rank} rank {n.rank}] "), lines
        assert want in lines[0], f"node {n.rank}: {lines[0]!r} lacks {want!r}"
        ours = re.search(r'File "[^"]*/megatron_qrl/', n.stderr)  # torchrun's own report aside
        assert ours is None, f"node {n.rank}:\n{n.stderr[-3000:]}"


def _cluster(head: dict, worker: dict, attempts: int = 3):
    """``(Cluster, worker node)``: a head and a worker raylet (a raylet that misses Ray's
    fixed 30 s start-up window on a loaded host is retried)."""
    from ray.cluster_utils import Cluster

    for attempt in range(attempts):
        cluster = Cluster()
        try:
            cluster.add_node(include_dashboard=False, **head)
            node = cluster.add_node(**worker)
            cluster.wait_for_nodes()
            return cluster, node
        except Exception:
            cluster.shutdown()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture
def two_raylets():
    """A Ray cluster of two nodes of 1 CPU each (fast node-death detection); yields
    ``(address, worker raylet pid)``."""
    ray = pytest.importorskip("ray")
    from ray import ray_constants

    cluster, worker = _cluster({"num_cpus": 1, "_system_config": {
        "health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
        "health_check_failure_threshold": 3}}, {"num_cpus": 1})
    pid = worker.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    try:
        yield cluster.address, pid
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_engine_node_lost_in_sharded_fleet_run_ends_with_one_line_per_node(tmp_path,
                                                                            two_raylets):
    """The worker raylet (one engine's node) is killed after the first rollout; the engine
    dies in the colocated fleet's memory release, is restarted in its bundle, which cannot be
    placed again (the head's CPU is the other engine's). Bound: 420 s (start-up of two
    engines, one sync, one rollout, the bundle wait of 15 s, the exits)."""
    address, raylet = two_raylets
    hf = make_tiny_hf(tmp_path / "hf", "moe")
    CharTokenizer().save(hf, hf=False)
    args = [*TINY, "--qrl-steps", "2", "--qrl-save-interval", "0", "--qrl-mode", "colocated",
            "--qrl-rollout-num-engines", "2", "--qrl-launch-startup-timeout-s", "15",
            "--qrl-output-dir", str(tmp_path / "out"),
            "--kill-node", f"{raylet}:release_memory:1",
            "--", "--load", str(hf), "--expert-model-parallel-size", "2"]
    nodes = finish(start_nodes(tmp_path, RAY_HELPER, args, env={"RAY_ADDRESS": address}),
                   bound_s=420)
    _one_line_each(nodes, "cannot be started again", "rank 0 stopped the job: PlacementError")


@pytest.mark.slow
def test_a_placement_that_cannot_fit_is_one_line(tmp_path):
    """2 engines + the trainer's bundle on a 2-CPU cluster (qrl-train joins it): one line
    with what the cluster has, read before the session closes. Bound: 120 s."""
    ray = pytest.importorskip("ray")
    ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                   RAY_ADDRESS=ctx.address_info["gcs_address"])
        cmd = [sys.executable, "-m", "megatron_qrl.rl.cli", *TINY, "--qrl-steps", "1",
               "--qrl-mode", "disaggregated", "--qrl-rollout-num-engines", "2",
               "--qrl-launch-startup-timeout-s", "3", "--qrl-output-dir", str(tmp_path / "o")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=120)
    finally:
        ray.shutdown()
    lines = [x for x in proc.stderr.splitlines() if x.startswith("qrl-train: error:")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and "--qrl-rollout-num-engines 2" in lines[0], proc.stderr[-3000:]
    assert "cannot place bundles" in lines[0] and "'CPU': 2.0" in lines[0], lines[0]


@pytest.mark.slow
def test_a_rank_failing_alone_is_named_by_the_other_node(tmp_path):
    """Resume where node 1's output directory lacks the checkpoint: node 1 says so, node 0
    names rank 1 and quotes its line. Bound: 240 s."""
    out, empty = tmp_path / "out", tmp_path / "node1-disk"
    first = finish(start_nodes(tmp_path, "-m megatron_qrl.rl.cli",
                               [*TINY, "--qrl-steps", "1", "--qrl-save-interval", "1"],
                               per_node={0: ["--qrl-output-dir", str(out)],
                                         1: ["--qrl-output-dir", str(out)]}), bound_s=240)
    assert [n.rc for n in first] == [0, 0], first[0].stderr[-3000:] + first[1].stderr[-3000:]
    empty.mkdir()
    nodes = finish(start_nodes(tmp_path, "-m megatron_qrl.rl.cli",
                               [*TINY, "--qrl-steps", "2", "--qrl-resume"],
                               per_node={0: ["--qrl-output-dir", str(out)],
                                         1: ["--qrl-output-dir", str(empty)]}), bound_s=240)
    _one_line_each(nodes, "lost rank 1, which failed:", "no checkpoint")


@pytest.mark.slow
def test_a_frozen_node_ends_the_job_after_the_collective_timeout(tmp_path):
    """Node 1's rank stops (SIGSTOP) once the run is under way: node 0 says, after the
    collective timeout (20 s), that no answer came. Bound: 120 s after the freeze (the 20 s
    timeout, then the exit; a CI machine's two cores also run another test worker)."""
    nodes = start_nodes(tmp_path, "-m megatron_qrl.rl.cli",
                        [*TINY, "--qrl-steps", "50", "--qrl-save-interval", "0",
                         "--qrl-launch-collective-timeout-s", "20",
                         "--qrl-output-dir", str(tmp_path / "out")])
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline and nodes[0].proc.poll() is None, nodes[0].stderr
        time.sleep(0.5)
    frozen = nodes[1].worker_pid()
    os.kill(frozen, signal.SIGSTOP)
    start = time.monotonic()
    try:
        (first,) = finish(nodes[:1], bound_s=120)
        took = time.monotonic() - start
    finally:
        os.kill(frozen, signal.SIGKILL)
        finish(nodes[1:], bound_s=30)
    assert first.rc is not None and took < 120, first.stderr[-3000:]
    lines = first.errors()
    assert first.rc not in (None, 0) and len(lines) == 1, first.stderr[-3000:]
    assert lines[0].startswith("qrl-train: error: [node 0 rank 0] no answer from the other "
                               "ranks within 20 s"), lines


@pytest.mark.slow
def test_colocated_bundle_is_pinned_to_the_drivers_node():
    """Head (the driver's node) 2 CPUs, worker 1 CPU: Ray's PACK best fit for a 1-CPU bundle
    is the worker; the colocated engine shares rank 0's device, so it must be the head."""
    ray = pytest.importorskip("ray")
    from megatron_qrl.rl.ray_modes import RaySession
    from megatron_qrl.rl.ray_placement import bundle_node

    cluster, _ = _cluster({"num_cpus": 2}, {"num_cpus": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        here = ray.get_runtime_context().get_node_id()
        for _ in range(2):
            with RaySession("colocated", pg_timeout_s=60) as session:
                assert bundle_node(session.pg, 0) == here
    finally:
        ray.shutdown()
        cluster.shutdown()
