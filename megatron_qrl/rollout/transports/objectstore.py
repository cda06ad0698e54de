"""Transport ``objectstore``: every bucket ``ray.put`` as it fills, the actor loads the
stream from the ObjectRefs (a full copy of the weights in the object store per sync).

Tensors of the 1-byte float dtypes (FP8 / NVFP4 codes and scales) travel as their ``uint8``
bytes plus the dtype (:class:`WireTensor`, :func:`megatron_qrl.sync.protocol.wire.as_bytes`):
torch's pickler cannot round-trip them (measured with torch 2.13: ``pickle.loads(pickle.
dumps(float8 tensor))`` fails in ``_legacy_load`` on ``UntypedStorage.dtype``), and Ray
pickles what it stores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...sync.protocol.wire import as_bytes, from_bytes
from ...sync.transport import Bucket, WeightTransport, register_transport
from .link import ActorLink

__all__ = ["ObjectStoreTransport", "WireTensor", "from_wire", "to_wire"]


@dataclass(frozen=True)
class WireTensor:
    """A tensor the object store cannot hold as is: its raw bytes and its dtype's name."""

    data: torch.Tensor
    dtype: str


def to_wire(t: torch.Tensor) -> torch.Tensor | WireTensor:
    """``t`` on the driver's CPU, in a form Ray can pickle (see the module docstring)."""
    raw, dtype = as_bytes(t.detach().cpu())
    return raw if dtype is None else WireTensor(raw, dtype)


def from_wire(t: torch.Tensor | WireTensor) -> torch.Tensor:
    """Undo :func:`to_wire`."""
    return from_bytes(t.data, t.dtype) if isinstance(t, WireTensor) else t


@register_transport("ray", "objectstore")
class ObjectStoreTransport(WeightTransport):
    """Buckets into the object store, then one ``update_weights(refs, version)`` call."""

    def __init__(self, link: ActorLink):
        self.link = link
        self.refs: list[Any] = []

    @property
    def bucket_bytes(self) -> int:  # type: ignore[override]
        return self.link.bucket_bytes

    def prepare(self, version: int) -> None:
        self.refs = []

    def send_bucket(self, item: tuple[Bucket, bool]) -> int:
        import ray

        bucket, _ = item
        if not bucket:  # an empty stream puts nothing
            return 0
        self.refs.append(ray.put([(name, to_wire(t)) for name, t in bucket]))
        return 1

    def finish(self, version: int) -> None:
        refs, self.refs = self.refs, []
        self.link.buckets_sent += len(refs)
        self.link.call("update_weights", refs, version)
