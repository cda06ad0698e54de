"""Ray engine + torchrun ranks: rank 0's messages to the other ranks, and its engine's re-syncs.

A weight sync gathers the trainer's full HF tensors to rank 0, a collective of every rank.
When the Ray engine actor dies inside a call on rank 0 (a rollout, a weight update, the
verification read-back), :class:`~megatron_qrl.rl.ray_modes.RayRolloutEngine` re-syncs the
trainer's current weights on the new actor — while the other ranks wait for rank 0 in a
broadcast (the rollout's, or the end of a sync). :class:`ResyncWorld` makes those waits
serve re-syncs, so the ranks' order of collectives is the same whether or not the actor
died, and the metrics equal those of an uninterrupted run.

Every broadcast from rank 0 in such a run is ONE message ``(kind, payload)`` of this module
(:func:`post` / :func:`receive`, nowhere else):

* ``DATA obj``: a broadcast's payload (:meth:`ResyncWorld.broadcast`);
* ``RESYNC``: a re-sync of a restarted engine follows; the other ranks join its gathers
  (``serve``). A rank waiting for a sharded sync's header treats it as the start of the
  re-sync that replaces the sync rank 0 gave up before its header;
* ``SYNC header``: a sharded weight sync starts (:mod:`megatron_qrl.rl.ep_sync`);
* ``STOP line``: rank 0 cannot go on (its engine fleet cannot recover); every other rank
  raises :class:`MainRankStopped` with rank 0's line and exits with one line of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist

from megatron_qrl.models.runtime import RankWorld

__all__ = ["DATA", "RESYNC", "STOP", "SYNC", "MainRankStopped", "ResyncWorld", "post",
           "receive", "stop_line"]

DATA, RESYNC, SYNC, STOP = "data", "resync", "sync", "stop"
KINDS = (DATA, RESYNC, SYNC, STOP)


class MainRankStopped(RuntimeError):
    """Rank 0 stopped the job (its ``STOP`` line is the message)."""


def stop_line(exc: BaseException) -> str:
    """The one line rank 0 sends with ``STOP``: the error's type and first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:400] if text else ''}".rstrip(": ")


def post(kind: str, payload: Any = None) -> None:
    """Rank 0: broadcast one message to the other ranks."""
    if kind not in KINDS:
        raise ValueError(f"rank message kind {kind!r}: one of {KINDS}")
    dist.broadcast_object_list([(kind, payload)], src=0)


def receive(*expected: str) -> tuple[str, Any]:
    """A rank > 0: rank 0's next message, one of ``expected``. ``STOP`` raises
    :class:`MainRankStopped`; another kind is a protocol error naming both."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    message = box[0]
    if not (isinstance(message, tuple) and len(message) == 2 and message[0] in KINDS):
        raise RuntimeError(f"rank {dist.get_rank()}: rank 0 sent {type(message).__name__} "
                           f"where a message {expected} was due (ranks out of step)")
    kind, payload = message
    if kind == STOP:
        raise MainRankStopped(f"rank 0 stopped the job: {payload}")
    if kind not in expected:
        raise RuntimeError(f"rank {dist.get_rank()}: rank 0 sent {kind!r} where {expected} "
                           "was due (ranks out of step)")
    return kind, payload


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
            post(DATA, obj)
            return obj
        while True:
            kind, payload = receive(DATA, RESYNC)
            if kind == DATA:
                return payload
            if self.serve is None:
                raise RuntimeError(f"rank {self.rank}: a re-sync announced, none served")
            self.serve()

    def from_main(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its result on every rank; rank 0's error stops the others."""
        if not self.is_main:
            return self.broadcast(None)
        try:
            obj = fn()
        except Exception as exc:
            self.stop(exc)
            raise
        return self.broadcast(obj)

    def announce_resync(self) -> None:
        """Rank 0, before a re-sync: the other ranks join its gathers."""
        if not self.is_main:
            raise RuntimeError("only rank 0 (the engine's owner) announces a re-sync")
        post(RESYNC)

    def stop(self, exc: BaseException) -> None:
        """Rank 0, on a failure it cannot recover from while the others wait for its
        message: they raise :class:`MainRankStopped` with ``exc``'s line (never raises)."""
        try:
            post(STOP, stop_line(exc))
        except Exception:  # noqa: BLE001 - a peer is gone: it reports the loss itself
            pass
