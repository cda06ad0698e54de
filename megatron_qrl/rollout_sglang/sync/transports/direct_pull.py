"""The direct sync's other end: the trainer's weights handed to the engine, which writes them
into its own tensors (:mod:`..loader.storage_write`) — for an engine started with its memory
saver (``--qrl-rollout-sglang-release-memory``, the default), whose parameters CUDA IPC cannot
export while the trainer's tensors it can.

Runs in the trainer's process. The stream (the same one :class:`.direct.DirectTransport`
writes itself) goes in ``write`` requests of the engine's storage service, each one CUDA IPC
handle per tensor: a weight still in high precision (the engine quantizes it into its
regions), a packed or high-precision tensor (copied). A request holds at most
``bucket_bytes`` of tensors that fill their own storage (views into a larger one — the
parameters in Megatron's contiguous buffer — count nothing), so the temporaries made for the
sync (expert stacks, gathered shards) live for one request. The last request answers the
fingerprints of what the engine wrote and its read-back digest of the same regions; one more
(``fingerprint``) then sets the weight version."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

from ..prefetch import timed
from ..session import SGLangSession

__all__ = ["requests_of", "send_pulled"]


def requests_of(stream: Iterable[tuple[str, torch.Tensor]], held_bytes: int,
                device: torch.device) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """``(items, last)`` per request: ``stream``'s tensors on ``device``, cut where the
    tensors that may have been made for the sync (those that fill their own storage; a view
    into a larger one, such as a parameter in Megatron's contiguous buffer, is kept by its
    owner) reach ``held_bytes``; one empty last request for an empty stream."""
    items: list[tuple[str, torch.Tensor]] = []
    held = 0
    for name, t in stream:
        if held >= held_bytes:
            yield items, False
            items, held = [], 0
        t = t.detach().to(device, non_blocking=True)
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().nbytes() <= nbytes:  # its own storage: perhaps made for the sync
            held += nbytes
        items.append((name, t))
    yield items, True


def send_pulled(s: SGLangSession, stream: Iterable[tuple[str, torch.Tensor]],
                version: int) -> dict[str, str]:
    """Send ``stream`` to be written by the engine (module docstring); the engine's
    fingerprints of what it wrote go to ``s.sent``; returns its read-back digest."""
    parts: dict[str, float] = {}
    t0 = time.perf_counter()
    n, out = 0, {}
    for items, last in requests_of(timed(stream, parts, "stream_s"), s.bucket_bytes,
                                   s.device):
        if s.device.type == "cuda":  # the engine's process reads what this one wrote
            torch.cuda.synchronize(s.device)
        out = s.storage({"what": "write", "format": s.spec.name, "first": n == 0,
                         "last": last}, items)
        n += 1
    # the version (and the cache flush) only after the last write succeeded: a request that
    # fails is answered, not raised, so SGLang would take a version sent with it
    s.storage({"what": "fingerprint", "version": version})
    s.sent.include(out["sent"])
    s.lap.update(buckets=n, write_s=time.perf_counter() - t0, **parts, engine_writes=True,
                 quantized=out["quantized"], copied=out["copied"])
    return out["digest"]
