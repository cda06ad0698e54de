"""Weights through shared memory: the driver's buckets opened in place by a Ray engine actor.

The ``ipc`` transport of :mod:`megatron_qrl.rollout.ray_actor`, for an engine on the driver's
node and device (``--qrl-mode colocated``): each bucket of the packed ``(hf_name, tensor)``
stream is flattened (:func:`megatron_qrl.sync.protocol.wire.flatten`) into one ``uint8`` buffer on
the bucket device, and only a small pickled handle to that buffer crosses to the actor —
the way SGLang's ``update_weights_from_tensor`` (its ``MultiprocessingSerializer``: torch's
``ForkingPickler`` with ``torch.multiprocessing.reductions``), verl and slime hand weights to
a colocated engine:

* CUDA (:func:`share` of a GPU buffer): the arguments of torch's ``rebuild_cuda_tensor``
  (a CUDA IPC memory handle, torch's IPC ref counter and event) with the device's UUID in
  place of its index — the actor's Ray-assigned ``CUDA_VISIBLE_DEVICES`` numbers the same
  GPU differently; SGLang swaps the same argument, by patching torch's reductions
  (``monkey_patch_torch_reductions``), which this module does not. The actor copies the
  bucket into its own memory (:func:`receive_ipc_stream`), so the engine never re-shares an
  imported IPC allocation.
* CPU: torch's ``file_system`` reduction (a named shared-memory segment); the default
  ``file_descriptor`` one passes the descriptor over ``multiprocessing``'s resource sharer,
  whose auth key two Ray processes do not share (measured with torch 2.13 / Ray 2.x:
  ``AuthenticationError: digest received was wrong``).

The handles travel on the weight group of the broadcast transport (gloo, CPU): per bucket
an ``int64[1]`` length then the pickled ``(BucketMeta, handle)``; a length 0 ends the
stream. The actor answers each bucket with an ``int64[1]`` broadcast from rank 1 once its
engine has asked for the next one (the bucket is loaded), and the driver frees a bucket only
after that answer, with at most two in flight: it fills bucket ``i + 1`` while the actor
loads ``i``. The order of the collectives on both sides is ``S0 S1 A0 S2 A1 ... END A(n-1)``
(``S``: a bucket's handle, ``A``: the actor's answer). A dead actor fails the driver's next
collective (gloo: "Connection closed by peer"), which :class:`~megatron_qrl.rollout.ray_actor.
RayEngine` turns into :class:`~megatron_qrl.rollout.supervisor.EngineDiedError` as for the
broadcast transport.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections import deque
from collections.abc import Iterable, Iterator
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions

from ..sync.protocol.wire import CutStream, flatten, iter_buckets, unflatten
from .broadcast import broadcast_from_trainer

__all__ = ["IPC_IN_FLIGHT", "device_uuid", "end_shared", "misplaced", "open_shared",
           "receive_ipc_stream", "send_ipc_stream", "send_shared", "share", "visible_devices"]

IPC_IN_FLIGHT = 2
"""Buckets the driver keeps alive at once (the one the actor loads, the one it fills)."""

_DEVICE_ARG = 6  # storage_device in torch.multiprocessing.reductions.rebuild_cuda_tensor


def misplaced(where: str) -> str:
    """The one message for an engine that cannot open the trainer's shared buckets
    (``where``: what the engine is or where it runs), naming the flag and the fix."""
    return ("--qrl-ray-weight-transport ipc shares the trainer's memory with the engine actor, "
            "so it needs the engine on the trainer's node and device (--qrl-mode colocated); "
            f"the rollout engine is {where}: use --qrl-ray-weight-transport broadcast (or auto)")


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` of this process (the same in every process)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_devices() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by index (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    old = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(old)


def share(t: torch.Tensor) -> bytes:
    """A pickled handle to ``t``'s memory for another process of this node (module
    docstring); ``t`` must stay alive until that process has opened it."""
    if t.is_cuda:
        _, args = reductions.reduce_tensor(t)
        args = list(args)
        if isinstance(args[_DEVICE_ARG], int):  # a process that imported SGLang has UUIDs
            args[_DEVICE_ARG] = device_uuid(args[_DEVICE_ARG])
        return pickle.dumps(("cuda", tuple(args)))
    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(t)
    return pickle.dumps(("cpu", buf.getvalue()))


def open_shared(handle: bytes) -> torch.Tensor:
    """The tensor :func:`share` made ``handle`` of (same memory, no copy)."""
    kind, payload = pickle.loads(handle)
    if kind == "cpu":
        return pickle.loads(payload)
    args = list(payload)
    uuid = args[_DEVICE_ARG]
    seen = visible_devices()
    if uuid not in seen:
        raise RuntimeError(misplaced(f"an actor that sees {seen or 'no GPU'}, not the "
                                     f"trainer's GPU {uuid}"))
    args[_DEVICE_ARG] = seen.index(uuid)
    return reductions.rebuild_cuda_tensor(*args)


def _send_message(group: dist.ProcessGroup, msg: bytes | None) -> None:
    n = 0 if msg is None else len(msg)
    broadcast_from_trainer(torch.tensor([n], dtype=torch.int64), group)
    if msg is not None:
        broadcast_from_trainer(torch.frombuffer(bytearray(msg), dtype=torch.uint8), group)


def _answer(group: dist.ProcessGroup) -> None:
    """The actor's answer (rank 1 -> rank 0) that its engine has loaded a bucket; the
    driver's call of this waits for it."""
    dist.broadcast(torch.zeros(1, dtype=torch.int64), group=group, group_src=1)


def send_shared(bucket: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup,
                device: torch.device | str, pending: deque[torch.Tensor]) -> None:
    """Hand one non-empty bucket to rank 1 as a shared buffer on ``device``; ``pending``:
    the buckets the actor may still read (this one joins them; with :data:`IPC_IN_FLIGHT`
    of them the oldest is let go once the actor answered)."""
    flat, meta = flatten([(name, t.to(device)) for name, t in bucket])
    if flat.is_cuda:  # the actor reads what the fill wrote (torch's IPC event does too)
        torch.cuda.current_stream(flat.device).synchronize()
    _send_message(group, pickle.dumps((meta, share(flat))))
    pending.append(flat)
    if len(pending) == IPC_IN_FLIGHT:
        _answer(group)
        pending.popleft()


def end_shared(group: dist.ProcessGroup, pending: deque[torch.Tensor]) -> None:
    """End the stream and wait for the actor's answer to the last bucket."""
    _send_message(group, None)
    if pending:
        _answer(group)


def send_ipc_stream(stream: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup,
                    device: torch.device | str, bucket_bytes: int) -> int:
    """Hand ``stream`` to rank 1 of ``group`` as shared buckets on ``device`` (module
    docstring); returns the number of buckets."""
    pending: deque[torch.Tensor] = deque()  # buckets the actor may still read
    n = 0
    for bucket in iter_buckets(stream, bucket_bytes):
        send_shared(bucket, group, device, pending)
        n += 1
    end_shared(group, pending)
    return n


def _receive_message(group: dist.ProcessGroup) -> bytes | None:
    size = torch.empty(1, dtype=torch.int64)
    broadcast_from_trainer(size, group)
    if int(size) == 0:
        return None
    msg = torch.empty(int(size), dtype=torch.uint8)
    broadcast_from_trainer(msg, group)
    return msg.numpy().tobytes()


def receive_ipc_stream(group: dist.ProcessGroup) -> CutStream:
    """The stream :func:`send_ipc_stream` hands over, bucket by bucket (views of the shared
    CPU bucket, or of this process's copy of a CUDA one), cut where the driver cut it
    (:class:`~megatron_qrl.sync.protocol.wire.CutStream`); the driver learns that a bucket
    is loaded when the consumer asks for the next one."""
    return CutStream(_shared_buckets(group))


def _shared_buckets(group: dist.ProcessGroup) -> Iterator[list[tuple[str, torch.Tensor]]]:
    loaded = False
    while True:
        msg = _receive_message(group)
        if loaded:
            _answer(group)
        if msg is None:
            return
        meta, handle = pickle.loads(msg)
        flat = open_shared(handle)
        if flat.is_cuda:
            flat = flat.clone()  # ours: the engine may share it on (CUDA IPC to its workers)
        loaded = True
        yield list(unflatten(flat, meta))
