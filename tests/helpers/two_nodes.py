"""Two "nodes" on this machine: one ``torchrun --nnodes 2 --node-rank R`` process per node.

:func:`start_nodes` starts both (``--master-addr 127.0.0.1``, a free port, one rank each
unless told), each running ``script ARGS`` with its own extra arguments and environment;
:func:`finish` waits for all of them within a bound and returns each node's exit code,
stderr and the seconds it took. The Ray side (two raylets) is ``ray.cluster_utils.Cluster``
in the tests that need it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_qrl.compat.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Node:
    rank: int
    proc: subprocess.Popen
    log: Path
    started: float
    rc: int | None = None
    seconds: float = 0.0

    @property
    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def errors(self) -> list[str]:
        """The ``qrl-train: error:`` lines of this node."""
        return [line for line in self.stderr.splitlines() if line.startswith("qrl-train: error:")]

    def worker_pids(self) -> list[int]:
        """The pids of this node's worker processes, torchrun's children."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                             text=True).stdout.split()
        return [int(p) for p in out]

    def worker_pid(self) -> int:
        """The pid of this node's (only) worker process."""
        pids = self.worker_pids()
        if not pids:
            raise RuntimeError(f"node {self.rank}: no worker process yet")
        return pids[0]

    def kill(self) -> None:
        """SIGKILL torchrun's process group and its workers' (torchrun starts each worker in
        a session of its own: killing torchrun alone leaves them running)."""
        for pgid in [*self.worker_pids(), self.proc.pid]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def start_nodes(tmp: Path, script: str | Path, args: list[str],
                per_node: dict[int, list[str]] | None = None,
                env: dict[str, str] | None = None, nodes: int = 2,
                nproc_per_node: int = 1, rdzv_timeout_s: int = 60) -> list[Node]:
    """Start ``nodes`` torchrun processes (module docstring); ``script`` a path or ``-m mod``."""
    port = free_port()
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    out = []
    for r in range(nodes):
        log = tmp / f"node{r}.stderr"
        target = script.split() if isinstance(script, str) else [str(script)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
               "--node-rank", str(r), "--nproc-per-node", str(nproc_per_node),
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--rdzv-conf", f"timeout={rdzv_timeout_s}", *target, *args,
               *(per_node or {}).get(r, [])]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                                env=base, cwd=ROOT, start_new_session=True)
        out.append(Node(r, proc, log, time.monotonic()))
    return out


def finish(nodes: list[Node], bound_s: float) -> list[Node]:
    """Wait up to ``bound_s`` for every node; a node still running then is killed (its
    workers too) and its ``rc`` left None."""
    deadline = time.monotonic() + bound_s
    for n in nodes:
        try:
            n.rc = n.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            n.kill()
            n.rc = None
        n.seconds = time.monotonic() - n.started
    return nodes
