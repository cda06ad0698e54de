"""The weight transports' one interface, their registry, and the one bucketing rule.

A transport moves the packed ``(hf_name, tensor)`` stream of one sync from the trainer to
an engine. Every transport is a :class:`WeightTransport` with four steps, driven by
:meth:`WeightTransport.send`:

1. :meth:`~WeightTransport.prepare` — before the first bucket: join or form a group, start
   the receiver's call, set up per-sync state;
2. :meth:`~WeightTransport.send_bucket` — one bucket, cut by :func:`cut` (the one rule,
   :func:`megatron_qrl.sync.protocol.wire.buckets`) and shaped by
   :meth:`~WeightTransport.encode`; a transport may only restrict where a cut may fall
   (:meth:`~WeightTransport.cuts`: the sharded sync cuts per segment), never resize;
3. :meth:`~WeightTransport.finish` — after the last bucket: the end mark, waiting for the
   receiver;
4. :meth:`~WeightTransport.verify` — what the receiver reports it received, checked against
   the fingerprints of what was sent (None where the transport has no receipt: the
   driver's manifest is compared with the engine's held checksums instead).

A failure anywhere between 1 and 3 goes to :meth:`~WeightTransport.fail` with the stream
(default: re-raise), where a transport drains the stream, tears its group down, and
raises the error its caller restarts on.

Transports register by side and name (:func:`register_transport`): sides ``ray`` (one Ray
engine actor) and ``fleet`` (every actor of a fleet at once) in
:mod:`megatron_qrl.rollout.transports`, side ``sglang`` (the in-process SGLang engine) in
:mod:`megatron_qrl.rollout_sglang.sync.transports`.
A name is registered once per side; ``auto`` is never a transport (it is resolved before
one is looked up: ``rollout.ray_actor.pick_transport``, ``SGLangOptions.sync_for``).
Imports only torch and :mod:`.protocol`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import torch

from .protocol.wire import buckets

__all__ = ["SIDES", "Bucket", "WeightTransport", "cut", "register_transport",
           "transport_class", "transport_names"]

Bucket = list[tuple[str, torch.Tensor]]
SIDES = ("ray", "fleet", "sglang")
"""Who receives: one Ray engine actor (``--qrl-ray-weight-transport`` names its transport),
every engine actor of a fleet at once, or an in-process SGLang engine (``SGLangOptions.sync``
names its transport)."""

_REGISTRY: dict[str, dict[str, type[WeightTransport]]] = {side: {} for side in SIDES}
T = TypeVar("T", bound="type[WeightTransport]")


def cut(stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
        ) -> Iterator[tuple[Bucket, bool]]:
    """THE bucketing rule of every transport: ``(bucket, is_last)`` of at most
    ``bucket_bytes`` (a larger tensor alone), one empty last bucket for an empty stream
    (:func:`megatron_qrl.sync.protocol.wire.buckets`)."""
    return buckets(stream, bucket_bytes)


class WeightTransport(ABC):
    """One sync's way from the trainer to an engine (module docstring). ``bucket_bytes``:
    the size :func:`cut` works to."""

    side: ClassVar[str] = ""
    name: ClassVar[str] = ""
    bucket_bytes: int = 256 * 2**20

    def prepare(self, version: int) -> None:
        """Before the first bucket of ``version`` (default: nothing)."""

    def wire(self, stream: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterable[tuple[str, torch.Tensor]]:
        """Per tensor, before the cut (fingerprints, expert stacks); default: unchanged."""
        return stream

    def cuts(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[Bucket, bool]]:
        """Where buckets are cut: :func:`cut` (a transport that keeps segments apart cuts
        each segment by the same rule)."""
        return cut(stream, self.bucket_bytes)

    def encode(self, bucket: Bucket, last: bool) -> Any:
        """What :meth:`send_bucket` takes for one bucket; default ``(bucket, last)``."""
        return bucket, last

    def produce(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Any]:
        """The encoded buckets of ``stream`` (a transport may prepare them ahead)."""
        for bucket, last in self.cuts(self.wire(stream)):
            yield self.encode(bucket, last)

    @abstractmethod
    def send_bucket(self, item: Any) -> int:
        """Send one encoded bucket; returns the buckets put on the wire (0: an empty bucket
        this transport does not send)."""

    def finish(self, version: int) -> None:
        """After the last bucket (default: nothing)."""

    def fail(self, exc: BaseException, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """A step raised ``exc``; ``stream``: what is left of the sync's stream. Default:
        re-raise (the caller's ``raise`` keeps the original traceback)."""

    def verify(self, sent: dict[str, str]) -> dict[str, str] | None:
        """What the receiver reports it received, checked against ``sent`` (raises
        ``WeightSyncError`` naming the tensor); None: this transport has no receipt."""
        return None

    def send(self, stream: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """One sync: prepare, every bucket, finish; returns the buckets sent."""
        source = iter(stream)
        sent = 0
        try:
            self.prepare(version)
            for item in self.produce(source):
                sent += self.send_bucket(item)
            self.finish(version)
        except BaseException as exc:
            self.fail(exc, source)
            raise
        return sent


def register_transport(side: str, name: str) -> Callable[[T], T]:
    """Class decorator: ``cls`` is transport ``name`` of ``side``; a second registration of
    the name on that side (or ``auto``) is refused."""
    if side not in SIDES:
        raise ValueError(f"register_transport: side {side!r} is not one of {SIDES}")

    def add(cls: T) -> T:
        if name == "auto" or name in _REGISTRY[side]:
            raise ValueError(f"weight transport {side}/{name!r} is already registered "
                             f"({_REGISTRY[side].get(name, 'auto is resolved, never sent')})")
        cls.side, cls.name = side, name
        _REGISTRY[side][name] = cls
        return cls

    return add


def transport_names(side: str) -> tuple[str, ...]:
    """The registered transports of ``side``, in registration order."""
    return tuple(_REGISTRY[side])


def transport_class(side: str, name: str, flag: str) -> type[WeightTransport]:
    """The transport ``name`` of ``side``; an unknown one is one error naming ``flag``."""
    try:
        return _REGISTRY[side][name]
    except KeyError:
        raise ValueError(f"{flag} {name!r}: choose one of {transport_names(side)}") from None
