"""Weight sync to an SGLang engine on other GPUs, the trainer's side: ``sync="distributed"``.

The trainer process is rank 0 of a weight-update group whose other ranks are the engine's
TP schedulers (SGLang's ``init_weights_update_group``; :func:`megatron_qrl.rollout.broadcast.init_group`
on our side). Each bucket of the packed stream is flattened into one ``uint8`` buffer
(:func:`~megatron_qrl.sync.protocol.wire.flatten`) and broadcast from the trainer's GPU:
- formats whose loaded layout is the checkpoint's (bf16): SGLang's own
  ``update_weights_from_distributed(load_format="flattened_bucket")``, which receives the
  buffer, re-views it by the names / dtypes / shapes of the request and calls
  ``model.load_weights``;
- quantized formats: ``update_weights_from_tensor`` with our in-place loader
  (:mod:`.loader`) and two small tensors — the bucket's metadata (``RECV``, naming the
  group) and the in-place control tensor; the loader receives the buffer on the same group,
  then reloads the modules as in a colocated in-place sync (and returns its receipt). SGLang's distributed path would
  call plain ``model.load_weights``, which fails or silently skips names on the
  post-processed quantized layers (docs/gpu_sglang_engine_sync.md).
The engine's request and the trainer's broadcast must run at the same time: the broadcast
runs in a thread of the trainer process while the request waits on the engine.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qrl.sync.protocol.checksums import WeightSyncError
from megatron_qrl.sync.protocol.wire import buckets, flatten

from ...rollout.broadcast import broadcast_from_trainer, free_port, init_group

__all__ = ["WeightGroup", "flat_buckets", "open_group", "run_alongside", "send_bucket"]


@dataclass
class WeightGroup:
    """The trainer's side of one weight-update group."""

    name: str
    pg: Any
    world_size: int
    device: torch.device


def run_alongside(call: Callable[[], Any], work: Callable[[], Any],
                  timeout_s: float = 600.0) -> Any:
    """``call()`` (the engine's request) here while ``work()`` (the trainer's side: its
    broadcast, or joining the group) runs in a thread; returns ``call()``'s result. The
    thread's error, or its not finishing within ``timeout_s`` after the request returned, is
    raised as :class:`WeightSyncError`. A request answered ``(False, message)`` is returned
    at once (the engine refused; the caller raises): the thread then waits on a peer that
    will not come and ends at the group's timeout."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # re-raised in the caller
            err.append(exc)

    th = threading.Thread(target=run, name="qrl-weight-broadcast", daemon=True)
    th.start()
    try:
        out = call()
    except BaseException:
        th.join(1.0)
        raise
    if isinstance(out, tuple) and out and out[0] is False:
        return out
    th.join(timeout_s)
    if th.is_alive():
        raise WeightSyncError(f"the trainer's weight broadcast did not finish within {timeout_s:.0f} s "
                              "after the engine's request returned (the engine never joined it)")
    if err:
        raise WeightSyncError(f"the trainer's side of the weight broadcast failed: {err[0]}") from err[0]
    return out


def send_bucket(flat: torch.Tensor, group: WeightGroup) -> None:
    """The trainer's side of one bucket: broadcast ``flat`` and wait until it is sent."""
    if group.device.type == "cuda":
        torch.cuda.set_device(group.device)  # this runs in run_alongside's thread
    broadcast_from_trainer(flat, group.pg)
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()


def open_group(init_engine_side: Callable[[str, int, int, str], tuple], tp_size: int,
               device: torch.device, backend: str = "nccl", host: str = "127.0.0.1",
               timeout_s: float = 600.0) -> WeightGroup:
    """Create the group: the trainer joins as rank 0 in a thread while
    ``init_engine_side(host, port, world_size, name)`` asks the engine to join as ranks
    1..tp_size (SGLang's ``init_weights_update_group``) and returns its ``(ok, message)``."""
    port, name, world = free_port(), f"qrl-weights-{uuid.uuid4().hex[:8]}", 1 + tp_size
    box: dict[str, Any] = {}

    def join() -> None:
        box["pg"] = init_group(host, port, world, 0, name, backend=backend, timeout_s=timeout_s)

    ok, msg = run_alongside(lambda: init_engine_side(host, port, world, name)[:2], join,
                            timeout_s=timeout_s)
    if not ok:
        raise WeightSyncError(f"SGLang could not join the weight-update group {name} at "
                              f"{host}:{port}: {msg}")
    return WeightGroup(name, box["pg"], world, device)


def flat_buckets(stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 device: torch.device) -> Iterator[tuple[list[str], torch.Tensor, list, bool]]:
    """``(names, flat uint8 buffer on device, BucketMeta, is_last)`` per bucket of ``stream``."""
    for bucket, last in buckets(stream, bucket_bytes):
        if not bucket:  # an empty stream: nothing to broadcast
            continue
        flat, meta = flatten([(n, t.to(device, non_blocking=True)) for n, t in bucket])
        yield [n for n, _ in bucket], flat, meta, last
