"""Transport ``broadcast`` (the default of ``--qrl-mode disaggregated``): the stream as
framed ``uint8`` buckets over a 2-rank process group with the engine actor.

On the first sync the driver (rank 0) and the actor (rank 1) form the group
``qrl-weights-<uuid>`` (rendezvous at the driver's node IP; NCCL when the driver has CUDA
and the SGLang engine has its own GPU, else gloo — a colocated engine shares the driver's
GPU, where NCCL cannot hold both ranks). With NCCL a watcher aborts the group if the actor
dies mid-send (NCCL does not notice a dead peer). Per sync the driver starts
``update_weights_broadcast`` on the actor, broadcasts each bucket
(:func:`~megatron_qrl.rollout.broadcast.send_frame`) while the actor's engine loads it,
ends the stream and waits for the call. A failed send kills the actor, drains the rest of
the stream (under torchrun it is a gather of every trainer rank) and raises
:class:`~megatron_qrl.rollout.supervisor.EngineDiedError`; the restarted actor gets a new
group."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ...sync.transport import Bucket, WeightTransport, register_transport
from ..broadcast import free_port, init_group, send_end, send_frame
from ..supervisor import EngineDiedError
from .link import ActorLink, Tracked

__all__ = ["BroadcastTransport", "FramedTransport", "join_group"]


class FramedTransport(WeightTransport):
    """Each bucket a frame (:func:`~megatron_qrl.rollout.broadcast.send_frame`) from rank 0
    of ``group``, the last followed by the end mark; ``device``: where the group's tensors
    live. The base of every broadcast over a weight group."""

    def __init__(self, group: Any, device: str, bucket_bytes: int):
        self.group, self.device, self.bucket_bytes = group, device, bucket_bytes

    def send_bucket(self, item: tuple[Bucket, bool]) -> int:
        bucket, last = item
        if bucket:
            send_frame(bucket, self.group, self.device)
        if last:
            send_end(self.group, self.device)
        return 1 if bucket else 0


@register_transport("ray", "broadcast")
class BroadcastTransport(FramedTransport):
    """Frames over the actor's weight group (module docstring)."""

    method = "update_weights_broadcast"
    """The actor's receiving call."""
    what = "broadcast"

    def __init__(self, link: ActorLink):
        self.link = link
        self._source: Tracked | None = None
        self._sending = threading.Event()

    @property
    def bucket_bytes(self) -> int:  # type: ignore[override]
        return self.link.bucket_bytes

    @property
    def group(self) -> Any:  # type: ignore[override]
        return self.link.group

    @property
    def device(self) -> str:  # type: ignore[override]
        """Where the group's tensors live."""
        return "cuda" if self.link.backend == "nccl" else "cpu"

    def connect(self) -> None:
        """Before the first sync: form the weight group (:func:`join_group`)."""
        join_group(self.link)

    def send(self, stream: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """The group formed once, then the actor's receiving call around the template."""
        if self.link.group is None:
            self.connect()
        sent = 0

        def during(ref: Any) -> None:
            nonlocal sent
            self._ref = ref
            sent = WeightTransport.send(self, stream, version)
            self.link.buckets_sent += sent

        self.link.call(self.method, version, during=during)
        return sent

    def prepare(self, version: int) -> None:
        self._sending.set()
        if self.link.abort_on_death:
            threading.Thread(target=self._abort_if_actor_dies, args=(self._ref, self._sending),
                             name="qrl-weight-watch", daemon=True).start()

    def wire(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        self._source = Tracked(stream)
        return self._source

    def finish(self, version: int) -> None:
        self._sending.clear()

    def fail(self, exc: BaseException, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """A failed send kills the actor, drains the stream and raises EngineDiedError (an
        error of the stream itself propagates)."""
        self._sending.clear()
        if not isinstance(exc, Exception):
            return
        self.link.kill()
        if self._source is not None and self._source.failed:
            return
        for _ in stream:  # under torchrun every trainer rank gathers this stream
            pass
        raise EngineDiedError(f"weight {self.what} to the rollout engine actor failed "
                              f"(group {self.link.group_name}): {type(exc).__name__}: "
                              f"{str(exc)[:300]}") from exc

    def _abort_if_actor_dies(self, ref: Any, sending: threading.Event) -> None:
        """While ``sending``: if the actor's receiving call ends in the actor's death, abort
        the group so the blocked send fails (an NCCL send to a dead peer otherwise waits for
        the group timeout, after which NCCL's watchdog may tear the trainer down)."""
        import ray

        while sending.is_set():
            ready, _ = ray.wait([ref], timeout=0.5)
            if not ready:
                continue
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                if sending.is_set() and self.link.group is not None:
                    try:
                        self.link.group.abort()
                    except Exception:  # noqa: BLE001 - the send fails at its timeout then
                        pass
            except Exception:  # noqa: BLE001 - an engine error: the actor drains the stream
                pass
            return


def join_group(link: ActorLink) -> None:
    """Form the 2-rank weight group with the actor (rank 1); the driver is rank 0 and hosts
    the rendezvous on its node. An actor that dies first is an EngineDiedError."""
    import ray

    host = ray.util.get_node_ip_address()
    port, name = free_port(), f"qrl-weights-{uuid.uuid4().hex[:12]}"
    joined = link.actor.join_weight_group.remote(host, port, 2, 1, name, link.backend,
                                                 link.timeout_s)
    result: dict[str, Any] = {}

    def rank0() -> None:
        try:
            result["group"] = init_group(host, port, 2, 0, name, link.backend, link.timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            result["error"] = exc

    thread = threading.Thread(target=rank0, name=name, daemon=True)
    thread.start()
    try:  # the actor's side finishes with the driver's (or the actor dies first)
        ray.get(joined, timeout=link.timeout_s + 30)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
        raise EngineDiedError(f"rollout engine actor died joining the weight group "
                              f"{name}: {type(exc).__name__}: {str(exc)[:300]}") from exc
    thread.join()
    if "error" in result:
        raise result["error"]
    link.group, link.group_name = result["group"], name
