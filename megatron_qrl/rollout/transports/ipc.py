"""Transport ``ipc`` (the default of ``--qrl-mode colocated``): for an engine on the
driver's node and device, each framed bucket is filled in memory the actor can open (CUDA
IPC on the GPU, a shared-memory segment on CPU: :mod:`megatron_qrl.rollout.ipc`) and only a
small pickled handle crosses, over the same gloo weight group as :mod:`.broadcast`. The
driver keeps each bucket alive until the actor answered for it, at most two at once: it
fills bucket ``i + 1`` while the actor loads ``i``. On the first sync the driver asks the
actor where it runs: an actor on another node or without the driver's GPU is one error
naming the flag and the fix. Dead actors and failed sends are handled as for
:mod:`.broadcast`."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from ...sync.transport import Bucket, register_transport
from ..ipc import device_uuid, end_shared, misplaced, send_shared
from .broadcast import BroadcastTransport, join_group
from .link import ActorLink

__all__ = ["IpcTransport", "check_ipc_peer"]


@register_transport("ray", "ipc")
class IpcTransport(BroadcastTransport):
    """Handles to shared buckets over the actor's weight group (module docstring)."""

    method = "update_weights_ipc"
    what = "ipc handles"

    def __init__(self, link: ActorLink):
        super().__init__(link)
        self._pending: deque[torch.Tensor] = deque()

    @property
    def device(self) -> str:
        return self.link.ipc_device

    def connect(self) -> None:
        check_ipc_peer(self.link)
        join_group(self.link)

    def prepare(self, version: int) -> None:
        self._pending = deque()  # buckets the actor may still read
        super().prepare(version)

    def send_bucket(self, item: tuple[Bucket, bool]) -> int:
        bucket, last = item
        if bucket:
            send_shared(bucket, self.link.group, self.device, self._pending)
        if last:
            end_shared(self.link.group, self._pending)
            self._pending = deque()
        return 1 if bucket else 0

    def send(self, stream: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        try:
            return super().send(stream, version)
        finally:
            self._pending = deque()  # a failed sync lets go of its buckets


def check_ipc_peer(link: ActorLink) -> None:
    """The ipc transport shares memory: the actor must run on this node and (CUDA buckets)
    see this process's GPU; else one error naming the flag and the fix."""
    import ray

    node, devices = link.call("ipc_peer")
    here = ray.get_runtime_context().get_node_id()
    where = None
    if node != here:
        where = f"on Ray node {node}, not the trainer's node {here}"
    elif link.ipc_device == "cuda":
        uuid = device_uuid(torch.cuda.current_device())
        if uuid not in devices:
            where = f"on GPUs {devices}, not the trainer's GPU {uuid}"
    if where is not None:
        raise ValueError(misplaced(f"an actor {where}"))
