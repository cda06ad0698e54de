"""examples/run_qwen3_30b_a3b.sh with ``DRY_RUN=1``: every node's commands, for 2 and 3 nodes.

The commands must describe ONE job: the same torchrun world on every trainer node (node ranks
0..N-1 once each, one explicit master address and port, the rendezvous timeout), the Ray head
on node 0 at that address, each engine node joining it and declaring its own GPUs, the
trainer waiting for the engine nodes (``--qrl-launch-ray-nodes``), absolute output and
checkpoint paths, and qrl-train arguments that its parser accepts. No ``ray stop`` anywhere;
a missing HEAD_ADDR and a bad RAY_AUTH_MODE are one-line refusals.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_qwen3_30b_a3b.sh"


def _dry_run(tmp_path: Path, **env: str) -> dict[int, list[list[str]]]:
    """``{node: [command argv, ...]}`` of the dry run (run from ``tmp_path``)."""
    run_env = dict(os.environ, DRY_RUN="1", **env)
    for key in ("HEAD_ADDR", "OUT", "SHARED_DIR", "RAY_AUTH_MODE", "NNODES", "MODE"):
        if key not in env:
            run_env.pop(key, None)
    out = subprocess.run(["bash", str(SCRIPT), "--num-layers", "4"], capture_output=True,
                         text=True, env=run_env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    nodes: dict[int, list[list[str]]] = {}
    node = None
    for line in out.stdout.splitlines():
        if line.startswith("# node "):
            node = int(line.split()[2].rstrip(":"))
            nodes[node] = []
        elif line.strip():
            nodes[node].append(shlex.split(line.rstrip(" &")))
    return nodes


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _trainers(nodes: dict[int, list[list[str]]]) -> dict[int, list[str]]:
    return {k: cmd for k, cmds in nodes.items() for cmd in cmds if cmd[0] == "torchrun"}


@pytest.mark.parametrize("nnodes, engine_nodes, mode", [
    (2, 1, "disaggregated"),   # 3 nodes: 2 trainer nodes + 1 engine node
    (1, 1, "disaggregated"),   # 2 nodes: 1 trainer node + 1 engine node
    (2, 0, "colocated"),       # 2 nodes: 2 trainer nodes, engines on their GPUs
    (1, 2, "disaggregated"),   # 3 nodes: 1 trainer node + 2 engine nodes
])
def test_dry_run_describes_one_job(tmp_path, nnodes, engine_nodes, mode):
    from megatron_qrl.rl.cli import build_parser

    nodes = _dry_run(tmp_path, HEAD_ADDR="10.0.0.1", CKPT="ckpt/qwen", NNODES=str(nnodes),
                     ENGINE_NODES=str(engine_nodes), MODE=mode, ENGINE_NODE_GPUS="4")
    assert sorted(nodes) == list(range(nnodes + engine_nodes))
    trainers = _trainers(nodes)
    assert sorted(trainers) == list(range(nnodes))
    for k, cmd in trainers.items():
        assert (_value(cmd, "--nnodes"), _value(cmd, "--node-rank")) == (str(nnodes), str(k))
        assert (_value(cmd, "--master-addr"), _value(cmd, "--master-port")) == \
            ("10.0.0.1", "29500")
        assert _value(cmd, "--rdzv-conf") == "timeout=600"
        qrl = cmd[cmd.index("megatron_qrl.rl.cli") + 1: cmd.index("--")]
        args = build_parser().parse_args(qrl)
        assert args.qrl_mode == mode
        assert args.qrl_launch_ray_nodes == 1 + engine_nodes  # waits for the engine nodes
        assert (args.qrl_launch_startup_timeout_s, args.qrl_launch_collective_timeout_s) == \
            (600.0, 900.0)
        assert args.qrl_output_dir == str(tmp_path / "qrl_runs" / "qwen3-30b-a3b-fp8")
        assert args.qrl_checkpoint == str(tmp_path / "ckpt" / "qwen")
        assert cmd[-2:] == ["--num-layers", "4"]  # extra arguments: Megatron flags
    assert len({tuple(c[c.index("-m"):]) for c in trainers.values()}) == 1  # one job
    (head,) = [c for c in nodes[0] if "ray" in c and "--head" in c]
    assert _value(head, "--node-ip-address") == "10.0.0.1" and "--block" in head
    assert _value(head, "--num-gpus") == ("8" if mode == "colocated" else "0")
    for e in range(nnodes, nnodes + engine_nodes):
        (cmd,) = nodes[e]
        assert cmd[:2] == ["ray", "start"] and _value(cmd, "--address") == "10.0.0.1:6379"
        assert _value(cmd, "--num-gpus") == "4"  # its own GPUs, not the fleet's
    flat = [a for cmds in nodes.values() for c in cmds for a in c]
    assert "stop" not in flat


def test_dry_run_overrides_for_a_smoke_run(tmp_path):
    """A tiny model, its preset and layout, shared output and a Ray auth token file."""
    shared = tmp_path / "shared"
    nodes = _dry_run(tmp_path, HEAD_ADDR="10.0.0.1", CKPT=str(tmp_path / "tiny"),
                     MODEL_SH=str(ROOT / "examples" / "models" / "tiny_qwen3_moe.sh"),
                     PRESET="tiny-cpu", PARALLEL="--expert-model-parallel-size 2",
                     SHARED_DIR=str(shared), RAY_AUTH_MODE="token",
                     RAY_AUTH_TOKEN_PATH=str(shared / "token"), GPUS_PER_NODE="1",
                     ENGINES="1", STEPS="2", STARTUP_TIMEOUT="120")
    cmd = _trainers(nodes)[0]
    mega = cmd[cmd.index("--") + 1:]
    assert _value(mega, "--num-experts") == "8" and _value(mega, "--hidden-size") == "128"
    assert _value(mega, "--expert-model-parallel-size") == "2"
    assert "--tensor-model-parallel-size" not in mega
    assert _value(cmd, "--qrl-preset") == "tiny-cpu"
    assert _value(cmd, "--qrl-output-dir") == str(shared / "qrl_runs" / "tiny-cpu-fp8")
    assert _value(cmd, "--qrl-launch-startup-timeout-s") == "120"
    assert _value(cmd, "--rdzv-conf") == "timeout=120"


@pytest.mark.parametrize("env, message", [
    ({"CKPT": "/c"}, "set HEAD_ADDR"),
    ({"CKPT": "/c", "HEAD_ADDR": "10.0.0.1", "RAY_AUTH_MODE": "token"}, "RAY_AUTH_TOKEN_PATH"),
    ({"CKPT": "/c", "HEAD_ADDR": "10.0.0.1", "RAY_AUTH_MODE": "yes"}, "disabled or token"),
])
def test_refusals_are_one_line(tmp_path, env, message):
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("HEAD_ADDR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True,
                         env=dict(run_env, DRY_RUN="1", **env), cwd=tmp_path, timeout=60)
    assert out.returncode != 0 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
