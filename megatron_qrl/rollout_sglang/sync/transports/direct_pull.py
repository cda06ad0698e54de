"""The direct sync's other end: the trainer's weights handed to the engine, which writes them
into its own tensors (:mod:`..loader.storage_write`) — for an engine started with its memory
saver (``--qrl-rollout-sglang-release-memory``, the default), whose parameters CUDA IPC cannot
export while the trainer's tensors it can.

Runs in the trainer's process. The stream (the same one :class:`.direct.DirectTransport`
writes itself) goes in ``write`` requests of the engine's storage service, each one CUDA IPC
handle per tensor: a weight still in high precision (the engine quantizes it into its
regions), a packed or high-precision tensor (copied). A request holds at most
``bucket_bytes`` of memory made for the sync (expert stacks, gathered shards, split fused
weights), so such temporaries live for one request while the trainer's parameters, however
they are allocated, cost no request: on CUDA the caching allocator's growth since the
stream began; elsewhere the tensors that fill their own storage (views into a larger one,
such as the parameters in Megatron's contiguous buffer, count nothing). A parameter the
engine opened in an earlier sync goes by name, with its fingerprint (:class:`HeldTensors`).
The last request, which also sets the weight version and flushes the engine's cache, answers
the fingerprints of what the engine wrote and its read-back digest of the same regions."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qrl.sync.protocol.checksums import Checksums
from megatron_qrl.sync.protocol.engine_layout import HeldTensorError

from ..prefetch import timed
from ..session import SGLangSession

__all__ = ["HeldTensors", "allocated", "requests_of", "send_pulled"]

log = logging.getLogger(__name__)


CHECKS_PER_REQUEST = 16
""":func:`requests_of` reads ``in_use`` once per ``held_bytes / CHECKS_PER_REQUEST`` bytes of
streamed tensors, not per tensor (a request then holds up to that much more than
``held_bytes``): a reading builds the allocator's whole statistics, ~0.1 ms by our estimate from
the code (not measured alone), ~40 ms over a 4B model's ~400 tensors."""


def requests_of(stream: Iterable[tuple[str, torch.Tensor]], held_bytes: int,
                device: torch.device, in_use: Callable[[], int] | None = None
                ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """``(items, last)`` per request: ``stream``'s tensors on ``device``, cut where the
    memory made for the sync reaches ``held_bytes``: ``in_use()`` (bytes allocated now)
    above its value when the stream began, read every ``held_bytes / CHECKS_PER_REQUEST``
    bytes of tensors; without ``in_use`` the bytes of the tensors that fill their own storage
    (perhaps made for the sync; a view into a larger one, such as a parameter in Megatron's
    contiguous buffer, is kept by its owner). One empty last request for an empty stream. The
    caller drops a request's items before asking for the next."""
    items: list[tuple[str, torch.Tensor]] = []
    held = since = 0
    step = max(held_bytes // CHECKS_PER_REQUEST, 1)
    base = in_use() if in_use is not None else 0
    for name, t in stream:
        if held >= held_bytes:
            yield items, False
            items, held, since = [], 0, 0
        t = t.detach().to(device, non_blocking=True)
        nbytes = t.numel() * t.element_size()
        if in_use is not None:
            since += nbytes
            if since >= step:
                held, since = in_use() - base, 0
        elif t.untyped_storage().nbytes() <= nbytes:
            held += nbytes
        items.append((name, t))
    yield items, True


def allocated(device: torch.device) -> Callable[[], int] | None:
    """:func:`requests_of`'s ``in_use`` on ``device``: the CUDA caching allocator's bytes in
    use (None elsewhere), read from its nested statistics (``memory_allocated`` flattens and
    sorts them all first)."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"][
        "current"]


@dataclass(frozen=True)
class _Seen:
    """A stream tensor as a sync sent it: its storage, held weakly (so that its identity
    cannot pass to another storage while this lives), the storage's address and the view."""

    ref: Any
    address: int
    view: tuple

    @classmethod
    def of(cls, t: torch.Tensor) -> _Seen:
        from torch.multiprocessing.reductions import StorageWeakRef

        st = t.untyped_storage()
        return cls(StorageWeakRef(st), st.data_ptr(),
                   (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype))

    def same(self, now: _Seen) -> bool:
        """``now`` is this tensor still: the same storage (alive since), at the same address,
        the same view of it."""
        return (not self.ref.expired() and self.ref.cdata == now.ref.cdata
                and self.address == now.address and self.view == now.view)


class HeldTensors:
    """The trainer's side of the tensors the engine holds across syncs
    (``SGLangOptions.hold_trainer_tensors``; the engine's side:
    :class:`~..loader.storage_write._Held`). A tensor whose storage lived through a whole
    sync at the same address with the same view (a parameter; a temporary made for a sync
    never does) is sent once more with ``keep``, after which the engine holds what it opened
    and the trainer sends its name only (``refs``) while that stays true; a sync that fails
    forgets everything, so the next sends every handle (``drop_held`` lets the engine's go)."""

    def __init__(self) -> None:
        self.kept: dict[str, _Seen] = {}
        """What the engine holds after the last sync that succeeded."""
        self.seen: dict[str, _Seen] = {}
        """Every tensor of the last sync that succeeded."""
        self._kept: dict[str, _Seen] = {}
        self._seen: dict[str, _Seen] = {}

    def split(self, items: list[tuple[str, torch.Tensor]], first: bool
              ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """A request's tensors to send and its message fields: ``refs`` (``[position, name]``
        of the tensors the engine holds), ``ref_sums`` (their fingerprints now: the engine
        checks that what it holds still reads this memory), ``keep`` (names it holds from now
        on)."""
        send, refs, keep, sums = [], [], [], Checksums()
        for i, (name, t) in enumerate(items):
            now = self._seen[name] = _Seen.of(t)
            held, before = self.kept.get(name), self.seen.get(name)
            if held is not None and held.same(now):
                refs.append([i, name])
                sums.add(name, t, kept=True)  # the trainer's own: fingerprinted in one batch
                self._kept[name] = held
                continue
            send.append((name, t))
            if before is not None and before.same(now):
                keep.append(name)
                self._kept[name] = now
        fields: dict[str, Any] = {"refs": refs, "keep": keep,
                                  "ref_sums": sums.result() if refs else {}}
        if first and not self.kept:
            fields["drop_held"] = True
        return send, fields

    def commit(self) -> None:
        """The sync succeeded: the engine holds what it was told to."""
        self.kept, self.seen, self._kept, self._seen = self._kept, self._seen, {}, {}


def send_pulled(s: SGLangSession, stream: Iterable[tuple[str, torch.Tensor]],
                version: int) -> dict[str, str]:
    """Send ``stream`` to be written by the engine (module docstring); the engine's
    fingerprints of what it wrote go to ``s.sent``; returns its read-back digest."""
    parts: dict[str, float] = {}
    t0 = time.perf_counter()
    n, out, referenced = 0, {}, 0
    held = s.state.pop("held", None) or HeldTensors()  # back only once the sync succeeded
    hold = s.options.hold_trainer_tensors and "held_off" not in s.state
    try:
        for items, last in requests_of(timed(stream, parts, "stream_s"), s.bucket_bytes,
                                       s.device, allocated(s.device)):
            if s.device.type == "cuda":  # the engine's process reads what this one wrote
                torch.cuda.synchronize(s.device)
            # the last write sets the version and flushes the engine's cache
            msg = {"what": "write", "format": s.spec.name, "first": n == 0, "last": last,
                   **({"version": version} if last else {})}
            send, fields = held.split(items, n == 0) if hold else (items, {})
            try:
                out = s.storage({**msg, **fields}, send)
                referenced += len(fields.get("refs", ()))
            except HeldTensorError as exc:  # answered before any write: the same request again
                s.state["held_off"] = str(exc)
                hold, held = False, HeldTensors()
                log.warning("%s; this engine gets every tensor's CUDA IPC handle from now on "
                            "(from the start: --no-qrl-rollout-sglang-hold-trainer-tensors)",
                            exc)
                out = s.storage({**msg, "drop_held": True}, items)
            del items, send  # the engine wrote them: memory made for them goes back now
            if s.device.type == "cuda":  # blocks the engine held past our del (IPC limbo)
                torch.cuda.ipc_collect()
            n += 1
    except Exception:
        # a request that fails is answered, not raised, so SGLang took the last write's
        # version all the same: its record goes back to the last complete sync's
        if "version" in s.state:
            with contextlib.suppress(Exception):
                s.storage({"what": "fingerprint", "version": s.state["version"]})
        raise
    s.state["version"] = version
    if hold:
        held.commit()
        s.state["held"] = held
    s.sent.include(out["sent"])
    s.lap.update(buckets=n, write_s=time.perf_counter() - t0, **parts, engine_writes=True,
                 quantized=out["quantized"], copied=out["copied"], loader_s=out["loader_s"],
                 held_refs=referenced,
                 **{f"loader_{k}_s": v for k, v in out.get("loader_parts", {}).items()})
    return out["digest"]
