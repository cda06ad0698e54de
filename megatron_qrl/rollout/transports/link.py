"""What a Ray transport needs of the engine actor's proxy: the typed :class:`ActorLink`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ActorLink", "Tracked"]


@dataclass
class ActorLink:
    """One engine actor as its transports see it (held by
    :class:`~megatron_qrl.rollout.ray_actor.RayEngine`, which reads and sets these).

    ``call(method, *args, during=None)``: the actor's ``method`` (``during(ref)`` runs
    between submitting and waiting); a dead actor is ``EngineDiedError``. ``kill()``: the
    actor is killed and never called again."""

    actor: Any
    call: Callable[..., Any]
    kill: Callable[[], None]
    bucket_bytes: int
    backend: str
    """The weight group's: ``gloo`` or ``nccl``."""
    timeout_s: float
    ipc_device: str
    """Where the ipc transport's buckets live (the engine's device)."""
    abort_on_death: bool
    """Abort the group when the actor dies mid-send (NCCL does not notice a dead peer;
    gloo fails the send at once, and its groups cannot be aborted)."""
    group: Any = None
    group_name: str | None = None
    buckets_sent: int = 0


class Tracked:
    """An iterator over ``source`` that records whether ``source`` itself raised."""

    def __init__(self, source: Iterable[Any]):
        self.source, self.failed = iter(source), False

    def __iter__(self) -> Tracked:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.source)
        except StopIteration:
            raise
        except BaseException:
            self.failed = True
            raise
