"""How a multi-node job starts and how long its ranks wait for each other (``--qrl-launch-*``).

The waits are bounded so that a node that never comes, a frozen node or a Ray cluster
without the engines' GPUs ends the job within minutes, each rank with one line naming what
it waited for (:mod:`megatron_qrl.utils.ranks`, :mod:`megatron_qrl.rl.ray_modes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .run import _int, _real

__all__ = ["LaunchConfig"]


@dataclass(frozen=True)
class LaunchConfig:
    """The launch's waits (module docstring)."""

    startup_timeout_s: float = field(default=300.0, metadata={"on_resume": "may change"})
    """Seconds the ranks wait at start for every torchrun rank to join (logging the missing
    nodes every 10 s), and rank 0 for the Ray cluster to show --qrl-launch-ray-nodes nodes
    and the engines' GPUs and to place the engines; then one line naming what is missing.
    Also the bound on placing a restarted engine again (its node may be gone)."""

    collective_timeout_s: float = field(default=600.0, metadata={"on_resume": "may change"})
    """Seconds a trainer rank waits in one collective (for a peer rank, or for rank 0's
    rollout / weight sync) before it gives up with one line: a frozen node ends the job after
    this long. Raise it above the longest rollout of your job (a 30B model's long generations)."""

    ray_nodes: int = field(default=0, metadata={"on_resume": "may change"})
    """Ray modes: nodes the Ray cluster must have before the engines are placed (rank 0 waits
    for them up to --qrl-launch-startup-timeout-s; 0: place on the nodes already there)."""

    def __post_init__(self) -> None:
        _real("--qrl-launch-startup-timeout-s", self.startup_timeout_s, 0.0, low_open=True)
        _real("--qrl-launch-collective-timeout-s", self.collective_timeout_s, 0.0,
              low_open=True)
        _int("--qrl-launch-ray-nodes", self.ray_nodes, 0)
