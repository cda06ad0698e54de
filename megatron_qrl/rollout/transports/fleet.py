"""Transport ``broadcast`` of side ``fleet``: weights to every engine of a fleet at once, ONE
broadcast group, each bucket sent once.

The driver (the trainer's sending rank) is rank 0 of a group whose ranks 1..N are the N
engine actors (:class:`~megatron_qrl.rollout.ray_actor.EngineActor`, each joining with
``join_weight_group``; gloo on CPU, NCCL where every engine has its own GPU). Per sync the
driver starts ``update_weights_broadcast(version)`` on every actor, then broadcasts the
packed stream as framed buckets (:class:`FleetFrames`, framed as :mod:`.broadcast` frames): one
broadcast per bucket (header, metadata, payload) however many engines listen, so the
trainer's send cost does not grow with N (NCCL / gloo broadcast trees fan it out).

A failure (an actor dead before or during the sync, a broken send) destroys the group on
the driver (so the live receivers' pending broadcasts fail instead of waiting for the
timeout), drains the stream (under torchrun every trainer rank gathers it), waits for every
actor's call and raises :class:`FleetSyncError` naming the dead engines: the fleet restarts
those and re-syncs (a new group for the new membership).

Trainer EP > 1 (:mod:`megatron_qrl.rl.ep_sync`): while :meth:`FleetBroadcast.sharded` is
active the sync has ``peers.senders`` senders, ONE group per sender
(:mod:`~megatron_qrl.rollout.weight_groups`): the driver is rank 0 of group 0, sender ``s``
(another trainer rank, reached through ``peers``: :class:`ShardedPeers`) hosts group ``s``, and
every engine actor joins all of them at the same rank and receives with
:func:`~megatron_qrl.rollout.weight_groups.receive_sharded`. The driver sends its segments
(:class:`~.sharded.SegmentTransport`), the other senders theirs.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from ...quant.expert_stacks import stack_experts
from ...sync.transport import register_transport
from ..broadcast import free_port, init_group
from ..supervisor import EngineDiedError
from ..weight_groups import weight_group_plan
from .broadcast import FramedTransport
from .sharded import SegmentTransport

__all__ = ["FleetBroadcast", "FleetFrames", "FleetSyncError", "ShardedPeers", "release_group"]


@register_transport("fleet", "broadcast")
class FleetFrames(FramedTransport):
    """One sync's frames on the fleet's group (:class:`FleetBroadcast` owns the group and
    the engines' calls around it)."""


class ShardedPeers(Protocol):
    """The driver's view of the other senders of a sharded sync (``rl.ep_sync``)."""

    senders: int

    def start(self, rejoin: str | None, world_size: int) -> list[tuple[str, int]]:
        """Tell every trainer rank a sync starts; ``rejoin``: the groups' base name when
        they are formed anew (the other senders then host theirs: their ``(host, port)``,
        returned in sender order 1, 2, ..., and block joining them)."""

    def finish(self, failed: bool) -> None:
        """After the driver's send: every trainer rank reports its sent manifest."""


class FleetSyncError(EngineDiedError):
    """A fleet sync failed; ``dead`` are the indices of the engines whose actor died."""

    def __init__(self, message: str, dead: Sequence[int]):
        super().__init__(message)
        self.dead = tuple(dead)


def _died(exc: BaseException) -> bool:
    import ray

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


class FleetBroadcast:
    """The fleet's weight group and its sends (module docstring).

    ``engines``: the :class:`~megatron_qrl.rollout.ray_actor.RayEngine` proxies (their
    ``actor`` handles); the group is formed on the first sync and again whenever the set of
    actors changed (a restart). ``broadcasts``: buckets sent, over all syncs. ``shardable``:
    the engine actors may receive a sharded sync (reference engines; an SGLang engine's TP
    ranks do not join the senders' groups yet, so its actor gets the gathered stream).
    ``stack_experts``: the engines take expert stacks, stacked here before the cut (see
    :class:`~megatron_qrl.rollout.ray_actor.RayEngine`).
    """

    def __init__(self, backend: str = "gloo", timeout_s: float = 300.0,
                 bucket_bytes: int = 256 * 2**20, shardable: bool = False,
                 stack_experts: bool = False):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"FleetBroadcast backend {backend!r}: gloo or nccl")
        self.backend, self.timeout_s, self.bucket_bytes = backend, timeout_s, bucket_bytes
        self.shardable, self.stack_experts = shardable, stack_experts
        self.group: Any = None
        self.group_name: str | None = None
        self._members: tuple[int, ...] = ()
        self.broadcasts = 0
        self.sync_s: list[float] = []
        """Per engine: seconds from the start of the last sync to that engine's load done."""
        self.peers: ShardedPeers | None = None
        self._senders = 1

    @contextmanager
    def sharded(self, peers: ShardedPeers) -> Iterator[None]:
        """Syncs inside send from ``peers.senders`` senders (module docstring)."""
        previous, self.peers = self.peers, peers
        try:
            yield
        finally:
            self.peers = previous

    def send(self, engines: Sequence[Any], stream: Iterable[tuple[str, torch.Tensor]],
             version: int) -> None:
        """Broadcast ``stream`` once to every engine as ``version`` (module docstring)."""
        import ray

        peers = self.peers
        senders = peers.senders if peers is not None else 1
        members = tuple(id(e.actor) for e in engines)
        rejoin = self.group is None or members != self._members or senders != self._senders
        if rejoin:
            self.close()
            if peers is not None:  # a dead engine raises before the other senders wait
                self._check_alive(engines)
        hosts: list[tuple[str, int]] = []
        if peers is not None:
            name = f"qrl-fleet-{uuid.uuid4().hex[:12]}" if rejoin else None
            hosts = peers.start(name, weight_group_plan([1] * len(engines)).group_world_size)
        if rejoin:
            try:
                self._join(engines, hosts, name if peers is not None else None)
            except BaseException:
                if peers is not None:  # every rank streams (its gathers), then reports
                    for _ in stream:
                        pass
                    peers.finish(True)
                raise
            self._members, self._senders = members, senders
        start = time.perf_counter()
        method = "update_weights_sharded" if peers is not None else "update_weights_broadcast"
        refs = [getattr(e.actor, method).remote(version) for e in engines]
        device = "cuda" if self.backend == "nccl" else "cpu"
        sent_error: str | None = None
        frames = SegmentTransport if peers is not None else FleetFrames
        if self.stack_experts and peers is None:  # before the one cut (RayEngine's note)
            stream = stack_experts(stream)
        try:
            self.broadcasts += frames(self.group, device, self.bucket_bytes).send(stream, version)
        except Exception as exc:  # noqa: BLE001 - a peer is gone: reported with the deaths
            sent_error = f"{type(exc).__name__}: {exc}"  # the text: see release_group
        if sent_error is not None:
            self.close()  # the live receivers' broadcasts fail now, not at the timeout
            for _ in stream:  # under torchrun every trainer rank gathers this stream
                pass
        if peers is not None:
            peers.finish(sent_error is not None)
        dead, errors, self.sync_s = [], [], [0.0] * len(engines)
        pending = dict(enumerate(refs))
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1,
                                timeout=self.timeout_s + 30)
            if not ready:
                raise FleetSyncError(f"fleet weight sync: engines {sorted(pending)} did not "
                                     f"finish within {self.timeout_s + 30:.0f} s", sorted(pending))
            i = next(k for k, r in pending.items() if r == ready[0])
            del pending[i]
            self.sync_s[i] = time.perf_counter() - start
            try:
                ray.get(ready[0])
            except Exception as exc:  # noqa: BLE001 - sorted below
                (dead if _died(exc) else errors).append((i, exc))
        if dead or sent_error is not None:
            self.close()
            what = "; ".join(f"engine {i}: {type(e).__name__}: {str(e)[:200]}" for i, e in dead)
            raise FleetSyncError(f"fleet weight sync of version {version} failed (group "
                                 f"{self.group_name}): {what or sent_error}",
                                 [i for i, _ in dead])
        if errors:  # an engine's own error (a bad stream): the group is still in step
            raise errors[0][1]

    @staticmethod
    def _check_alive(engines: Sequence[Any]) -> None:
        """Every engine started (an SGLang engine takes minutes), else FleetSyncError."""
        import ray

        dead = []
        for i, e in enumerate(engines):
            try:
                ray.get(e.actor.weight_version.remote())
            except Exception as exc:  # noqa: BLE001 - a dead engine is restarted by the fleet
                if not _died(exc):
                    raise
                dead.append(i)
        if dead:
            raise FleetSyncError(f"engines {dead} died before joining the fleet weight group",
                                 dead)

    def _join(self, engines: Sequence[Any], peer_hosts: Sequence[tuple[str, int]] = (),
              base: str | None = None) -> None:
        """Form the group: the driver rank 0 (rendezvous host), engine ``i`` rank ``i + 1``;
        with ``peer_hosts`` also the other senders' groups (sender ``s`` hosts group ``s``)."""
        import ray

        host = ray.util.get_node_ip_address()
        port, name = free_port(), base or f"qrl-fleet-{uuid.uuid4().hex[:12]}"
        # each engine actor is one rank here: it receives the stream and hands it to its
        # engine (an SGLang engine of TP > 1 passes it on to its TP ranks in-process)
        plan = weight_group_plan([1] * len(engines), senders=1 + len(peer_hosts))
        world = plan.group_world_size
        if peer_hosts:  # every actor joins group 0, then group 1, ... (module docstring)
            extra = [(h, p, plan.group_name(name, s))
                     for s, (h, p) in enumerate(peer_hosts, start=1)]
            name = plan.group_name(name, 0)
        self._check_alive(engines)
        dead: list[int] = []
        joins = [e.actor.join_weight_group.remote(host, port, world, plan.offset(i), name,
                                                  self.backend, self.timeout_s,
                                                  extra if peer_hosts else ())
                 for i, e in enumerate(engines)]
        result: dict[str, Any] = {}

        def rank0() -> None:
            try:
                result["group"] = init_group(host, port, world, 0, name, self.backend,
                                             self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        thread = threading.Thread(target=rank0, name=name, daemon=True)
        thread.start()
        for i, ref in enumerate(joins):
            try:
                ray.get(ref, timeout=self.timeout_s + 30)
            except Exception as exc:  # noqa: BLE001 - a dead engine is restarted by the fleet
                if not _died(exc):
                    raise
                dead.append(i)
        if dead:  # rank 0 waits for the missing ranks until its timeout: do not join it
            raise FleetSyncError(f"engines {dead} died joining the fleet weight group {name}",
                                 dead)
        thread.join()
        if "error" in result:
            raise result["error"]
        self.group, self.group_name = result["group"], name

    def close(self) -> None:
        """Destroy the group on the driver (a peer may be dead; never raises)."""
        if self.group is None:
            return
        group, self.group, self._members = self.group, None, ()
        release_group(group)


def release_group(group: Any) -> None:
    """Destroy ``group`` and free it now (never raises). A gloo group that is destroyed but
    still referenced keeps its connections open, so its other ranks' pending broadcasts wait
    for the group's timeout instead of failing (measured: a receiver blocked 60 s of a 60 s
    timeout vs 1 s once freed). The usual holder is the traceback of the send that failed
    (its frames hold the group; torch's c10d exception logger keeps them in a reference
    cycle): callers keep only the error's text and release after their except block."""
    import gc

    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - best effort: the group is unusable either way
        pass
    del group
    gc.collect()
