"""Where the Ray modes' engines go, and the bounded waits around it (rank 0 only).

* :func:`wait_for_cluster`: before placing anything, wait until the Ray cluster has the
  nodes (``--qrl-launch-ray-nodes``) and GPUs the engines need, logging ``waiting for N
  nodes / M GPUs`` (engine nodes join the cluster while the trainer starts);
* :func:`wait_for_placement`: the placement group within the start-up timeout;
* :func:`wait_for_bundle`: before a restarted engine is created in its bundle, the bundle
  must be placed again (its node may have left the cluster: Ray then reschedules the bundle
  and, where nothing fits, never places it; an actor created there would wait forever);
* :func:`driver_node_selector`: colocated bundles pinned to the driver's node (rank 0's).

Every timeout is one :class:`PlacementError` naming the flag and what the cluster has.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["PlacementError", "bundle_node", "driver_node_selector", "wait_for_bundle",
           "wait_for_cluster", "wait_for_placement"]

NODE_ID_LABEL = "ray.io/node-id"
"""Ray's label of every node's id (``ray.util.placement_group.NODE_ID_LABEL_KEY``)."""


class PlacementError(RuntimeError):
    """The Ray cluster cannot place the engines (in time); the message says what it has."""


def _alive() -> tuple[int, float, dict[str, float]]:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = sum(float(n.get("Resources", {}).get("GPU", 0)) for n in nodes)
    return len(nodes), gpus, dict(ray.cluster_resources())


def wait_for_cluster(nodes: int, gpus: float, timeout_s: float,
                     log: Callable[[str], None] = print, every_s: float = 10.0) -> None:
    """Wait until the cluster has ``nodes`` alive nodes and ``gpus`` GPUs (module
    docstring); :class:`PlacementError` after ``timeout_s``."""
    start = last = time.monotonic()
    have_nodes, have_gpus, res = _alive()
    if have_nodes >= nodes and have_gpus >= gpus:
        return
    log(f"[qrl-train] waiting for {nodes} Ray nodes / {gpus:g} GPUs (have {have_nodes} / "
        f"{have_gpus:g}; up to {timeout_s:.0f} s, --qrl-launch-startup-timeout-s)")
    while have_nodes < nodes or have_gpus < gpus:
        now = time.monotonic()
        if now - start > timeout_s:
            raise PlacementError(
                f"waited {timeout_s:.0f} s for {nodes} Ray nodes / {gpus:g} GPUs; the cluster "
                f"has {have_nodes} / {have_gpus:g} ({res}): start the engine nodes (ray start "
                "--address HEAD:PORT --num-gpus N), or lower --qrl-launch-ray-nodes / the "
                "engines, or raise --qrl-launch-startup-timeout-s")
        if now - last >= every_s:
            log(f"[qrl-train] still waiting for Ray nodes / GPUs: {have_nodes} / {have_gpus:g} "
                f"of {nodes} / {gpus:g} ({now - start:.0f} s)")
            last = now
        time.sleep(0.5)
        have_nodes, have_gpus, res = _alive()


def wait_for_placement(session: Any, bundles: Any, strategy: str, what: str, fix: str) -> None:
    """Wait up to ``session.pg_timeout_s`` for ``session.pg``; on a timeout close the session
    and raise one :class:`PlacementError` naming ``what`` (the flag), the bundles, the
    cluster (read before the session closes) and ``fix``."""
    import ray

    try:
        ray.get(session.pg.ready(), timeout=session.pg_timeout_s)
    except ray.exceptions.GetTimeoutError:
        resources = dict(ray.cluster_resources())
        session.__exit__(None, None, None)
        raise PlacementError(
            f"{what}: the Ray cluster cannot place bundles {bundles} ({strategy}) within "
            f"{session.pg_timeout_s:.0f} s (--qrl-launch-startup-timeout-s); it has "
            f"{resources} — {fix}") from None


def bundle_node(pg: Any, index: int) -> str | None:
    """The node id bundle ``index`` of ``pg`` is placed on (None: not placed now)."""
    from ray.util import placement_group_table

    table = placement_group_table(pg)
    if table.get("state") != "CREATED":
        return None
    return table.get("bundles_to_node_id", {}).get(index) or None


def wait_for_bundle(pg: Any, index: int, timeout_s: float, what: str) -> None:
    """Wait until bundle ``index`` is placed (module docstring); else :class:`PlacementError`
    naming ``what`` (the engine) and the cluster's alive nodes and resources."""
    start = time.monotonic()
    while bundle_node(pg, index) is None:
        if time.monotonic() - start > timeout_s:
            nodes, gpus, res = _alive()
            raise PlacementError(
                f"{what} cannot be started again: its placement-group bundle {index} was not "
                f"placed within {timeout_s:.0f} s (--qrl-launch-startup-timeout-s; its node "
                f"left the Ray cluster, which has {nodes} alive node(s), {res}); bring the "
                "node back and restart the job with --qrl-resume")
        time.sleep(0.2)


def driver_node_selector(count: int) -> list[dict[str, str]]:
    """``bundle_label_selector`` pinning ``count`` bundles to this process's Ray node."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return [{NODE_ID_LABEL: node} for _ in range(count)]
