"""Weights over a collective: a process group shared by the trainer's sender and the engine.

The trainer process is rank 0 of a small group whose other ranks are the engine's processes
(SGLang's TP workers, or a Ray engine actor); each bucket of the packed ``(hf_name, tensor)``
stream is flattened into one ``uint8`` buffer and broadcast from rank 0 — one collective per
bucket, no object store, no host copy on an NCCL group.

:func:`init_group` meets SGLang's ``init_weights_update_group`` (SGLang 0.5.17
``sglang.srt.utils.init_custom_process_group``): a TCP rendezvous at ``host:port``, a
``PrefixStore`` named after the group, and torch's process-group constructor, so the trainer
and the engine's schedulers join the same group. Buckets are laid out by
:func:`megatron_qrl.sync.protocol.wire.flatten` (SGLang's ``FlattenedTensorBucket`` layout), so
SGLang's ``update_weights_from_distributed(load_format="flattened_bucket")`` reconstructs
them.

:func:`send_stream` / :func:`receive_stream` frame a whole stream for receivers that are not
SGLang (the Ray engine actor): per bucket a header ``int64[2]`` = (metadata bytes, payload
bytes), the JSON metadata, then the payload; a ``(0, 0)`` header ends the stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from ..sync.protocol.wire import (
    CutStream,
    flatten,
    iter_buckets,
    json_tensor,
    tensor_json,
    unflatten,
)
from ..utils.net import free_port

__all__ = ["broadcast_from_trainer", "find_group", "free_port", "init_group", "receive_stream",
           "send_end", "send_frame", "send_stream"]


def init_group(host: str, port: int, world_size: int, rank: int, group_name: str,
               backend: str = "nccl", timeout_s: float = 600.0) -> dist.ProcessGroup:
    """Join the weight-update group ``group_name`` as ``rank`` of ``world_size``.

    The same construction as SGLang's ``init_custom_process_group`` (rendezvous at
    ``tcp://host:port`` where rank 0 hosts the store, ``PrefixStore(group_name)``, torch's
    process-group helper), which is what SGLang's engine runs in ``init_weights_update_group``
    — so either side may be SGLang. Needs no default process group, and works in a torchrun
    rank (rank 0 hosts the store itself). Blocks until every rank has reached the store; an
    NCCL group connects at its first collective.
    """
    from torch.distributed import distributed_c10d as c10d

    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"init_group: rank {rank} of world_size {world_size}; the trainer is "
                         "rank 0 and the engine's processes ranks 1..world_size-1")
    timeout = timedelta(seconds=timeout_s)
    # the store SGLang's rendezvous builds (rank 0 hosts it), made directly: under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=True) c10d.rendezvous makes every rank a client of the
    # agent's store, so nobody would host this one (torch 2.13 rendezvous._create_c10d_store)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                          multi_tenant=True)
    store = dist.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                           group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def find_group(group_name: str) -> dist.ProcessGroup:
    """The process group this process joined under ``group_name`` (by :func:`init_group` or
    SGLang's ``init_weights_update_group``)."""
    from torch.distributed import distributed_c10d as c10d

    for pg, name in c10d._world.pg_names.items():
        if name == group_name:
            return pg
    raise KeyError(f"no process group named {group_name!r} in this process; known: "
                   f"{sorted(c10d._world.pg_names.values())}")


def broadcast_from_trainer(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Broadcast ``t`` from rank 0 (the trainer) of the weight group, in place on the others."""
    dist.broadcast(t, group=group, group_src=0)


def send_frame(bucket: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup,
               device: torch.device | str) -> None:
    """Broadcast one non-empty bucket from rank 0 as a frame (header, metadata, payload;
    module docstring). ``device``: where the group's tensors live (``cuda`` for NCCL)."""
    flat, meta = flatten([(name, t.to(device)) for name, t in bucket])
    head = json_tensor(meta, device)
    broadcast_from_trainer(torch.tensor([head.numel(), flat.numel()], dtype=torch.int64, device=device), group)
    broadcast_from_trainer(head, group)
    broadcast_from_trainer(flat, group)


def send_end(group: dist.ProcessGroup, device: torch.device | str) -> None:
    """The ``(0, 0)`` header that ends a framed stream."""
    broadcast_from_trainer(torch.zeros(2, dtype=torch.int64, device=device), group)


def send_stream(stream: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup,
                device: torch.device | str, bucket_bytes: int) -> int:
    """Broadcast ``stream`` from rank 0 as framed buckets (module docstring); returns the
    number of buckets. ``device``: where the group's tensors live (``cuda`` for NCCL)."""
    n = 0
    for bucket in iter_buckets(stream, bucket_bytes):
        send_frame(bucket, group, device)
        n += 1
    send_end(group, device)
    return n


def receive_stream(group: dist.ProcessGroup, device: torch.device | str) -> CutStream:
    """The stream :func:`send_stream` broadcasts, bucket by bucket as it arrives (tensors are
    views of their bucket's buffer on ``device``), cut where the sender cut it
    (:class:`~megatron_qrl.sync.protocol.wire.CutStream`: an engine that buckets again keeps
    these buckets)."""
    return CutStream(_frames(group, device))


def _frames(group: dist.ProcessGroup, device: torch.device | str
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    while True:
        sizes = torch.empty(2, dtype=torch.int64, device=device)
        broadcast_from_trainer(sizes, group)
        n_meta, n_flat = (int(x) for x in sizes.tolist())
        if n_meta == 0:
            return
        head = torch.empty(n_meta, dtype=torch.uint8, device=device)
        broadcast_from_trainer(head, group)
        flat = torch.empty(n_flat, dtype=torch.uint8, device=device)
        broadcast_from_trainer(flat, group)
        yield list(unflatten(flat, tensor_json(head)))
