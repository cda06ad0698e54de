"""Ray engine + torchrun ranks: rank 0's engine restarts re-sync with every rank's help.

A weight sync gathers the trainer's full HF tensors to rank 0, a collective of every rank.
When the Ray engine actor dies inside a call on rank 0 (a rollout, a weight update, the
verification read-back), :class:`~megatron_qrl.rl.ray_modes.RayRolloutEngine` re-syncs the
trainer's current weights on the new actor — while the other ranks wait for rank 0 in a
broadcast (the rollout's, or the end of a sync). :class:`ResyncWorld` makes those waits
serve re-syncs: rank 0 broadcasts ``("resync", None)`` before each re-sync and
``("data", obj)`` for a payload; the other ranks join the gathers of each announced re-sync
(``serve``) until the payload arrives. The ranks' order of collectives is therefore the same
whether or not the actor died, and the metrics equal those of an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from megatron_qrl.models.runtime import RankWorld

__all__ = ["ResyncWorld"]


@dataclass(frozen=True)
class ResyncWorld(RankWorld):
    """A :class:`RankWorld` whose ``broadcast`` serves rank 0's announced re-syncs."""

    serve: Callable[[], None] | None = None
    """Non-main ranks: this rank's part of one re-sync (the gathers of ``iter_hf_tensors``)."""

    @classmethod
    def of(cls, world: RankWorld, serve: Callable[[], None]) -> ResyncWorld:
        return cls(**{f.name: getattr(world, f.name) for f in fields(RankWorld)}, serve=serve)

    def broadcast(self, obj: Any) -> Any:
        if self.is_main:
            super().broadcast(("data", obj))
            return obj
        while True:
            kind, payload = super().broadcast(None)
            if kind == "data":
                return payload
            if kind != "resync" or self.serve is None:
                raise RuntimeError(f"rank {self.rank}: unexpected message {kind!r} from rank 0")
            self.serve()

    def announce_resync(self) -> None:
        """Rank 0, before a re-sync: the other ranks join its gathers."""
        if not self.is_main:
            raise RuntimeError("only rank 0 (the engine's owner) announces a re-sync")
        super().broadcast(("resync", None))
