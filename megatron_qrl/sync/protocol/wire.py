"""How packed tensors travel: byte views, flat buckets, JSON beside tensors, and one
bucketing rule. Every transport of the weight sync uses these (the Ray actor's object store
and broadcast, SGLang's CUDA-IPC buckets and its weight-update group).

* Byte views: a 1-byte float (float8 codes and scales) travels as its ``uint8`` bytes plus
  its dtype's name (:func:`as_bytes` / :func:`from_bytes`): torch's pickler cannot round-trip
  float8 storage (torch 2.13, ``UntypedStorage.dtype``) and SGLang's CUDA-IPC path only sees
  plain integer storage.
* Flat buckets: :func:`flatten` lays a bucket out as SGLang's ``FlattenedTensorBucket`` does
  (each tensor's bytes in order, one ``uint8`` buffer) with its :data:`BucketMeta`;
  :func:`unflatten` gives back views.
* Buckets: :func:`buckets` cuts a stream into lists of at most ``bucket_bytes`` (a larger
  tensor is its own bucket) and marks the last one; an empty stream is one empty last bucket.
  A stream that arrives cut (:class:`CutStream`: the buckets a sender framed, as a receiver
  reads them) keeps its buckets: :func:`buckets` gives them back instead of cutting again,
  and :func:`per_bucket` applies a per-tensor step inside each, so a stream is cut once
  between the trainer and the engine.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["BucketMeta", "CutStream", "as_bytes", "bucket_nbytes", "buckets", "dtype_name", "flatten",
           "from_bytes", "iter_buckets", "json_tensor", "nbytes", "per_bucket", "tensor_json", "unflatten"]

BucketMeta = list[tuple[str, str, list[int]]]
"""One bucket's ``(name, dtype name without "torch.", shape)`` per tensor, in payload order."""

_PICKLE_SAFE_1B = (torch.uint8, torch.int8, torch.bool)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"`` (``getattr(torch, name)`` inverts it)."""
    return str(dtype).removeprefix("torch.")


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def as_bytes(t: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """``(t viewed as uint8, its dtype name)`` for a 1-byte float, else ``(t, None)``."""
    if t.element_size() == 1 and t.dtype not in _PICKLE_SAFE_1B:
        return t.contiguous().view(torch.uint8), dtype_name(t.dtype)
    return t, None


def from_bytes(t: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """Undo :func:`as_bytes` (``dtype`` None: ``t`` unchanged)."""
    return t if dtype is None else t.view(getattr(torch, dtype))


def flatten(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, BucketMeta]:
    """One ``uint8`` buffer holding every tensor's bytes in order (SGLang's
    ``FlattenedTensorBucket`` layout) and its :data:`BucketMeta`."""
    if not named:
        raise ValueError("flatten: empty bucket")
    meta = [(n, dtype_name(t.dtype), list(t.shape)) for n, t in named]
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named])
    return flat, meta


def bucket_nbytes(meta: BucketMeta) -> int:
    """Bytes of the flat buffer :data:`BucketMeta` describes."""
    return sum(getattr(torch, dtype).itemsize * int(torch.Size(shape).numel())
               for _, dtype, shape in meta)


def unflatten(flat: torch.Tensor, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` as the tensors :func:`flatten` packed (no copy)."""
    out, pos = [], 0
    for name, dtype, shape in meta:
        dt = getattr(torch, dtype)
        n = dt.itemsize
        for s in shape:
            n *= s
        out.append((name, flat[pos:pos + n].view(dt).reshape(shape)))
        pos += n
    if pos != flat.numel():
        raise ValueError(f"unflatten: metadata covers {pos} bytes, the buffer holds {flat.numel()}")
    return out


def json_tensor(obj: Any, device: torch.device | str = "cpu") -> torch.Tensor:
    """``obj`` as JSON bytes in a ``uint8`` tensor (metadata that travels beside tensors)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)


def tensor_json(t: torch.Tensor) -> Any:
    """Inverse of :func:`json_tensor`."""
    # one buffer copy (a bucket's meta is ~0.3 MB: tolist() took ~6 ms of it per bucket)
    return json.loads(t.detach().to("cpu", torch.uint8).contiguous().numpy().tobytes().decode())


class CutStream:
    """A ``(name, tensor)`` stream that is already cut into buckets (``received``: the
    buckets as they arrive, each a list; a receiver does not know which frame is the last
    until the end mark, so :meth:`cuts` marks none and ends with one empty last bucket).
    An iterator over its tensors; :func:`buckets` gives its buckets back. One pass: what one
    way reads, the other does not see again."""

    def __init__(self, received: Iterable[list[tuple[str, torch.Tensor]]]):
        self._received = iter(received)
        self._pending: deque[tuple[str, torch.Tensor]] = deque()  # the bucket being iterated

    def cuts(self) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
        """``(bucket, is_last)`` as they arrive (the rest of one partly iterated first),
        then ``([], True)``."""
        if self._pending:
            rest, self._pending = list(self._pending), deque()
            yield rest, False
        for bucket in self._received:
            if bucket:
                yield bucket, False
        yield [], True

    def __iter__(self) -> CutStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        while not self._pending:
            self._pending = deque(next(self._received))
        return self._pending.popleft()


def per_bucket(stream: Iterable[tuple[str, torch.Tensor]], step: Any
               ) -> Iterable[tuple[str, torch.Tensor]]:
    """``step(stream)`` (a per-tensor step: ``stream -> stream``), bucket by bucket when
    ``stream`` is a :class:`CutStream` (the result is cut where ``stream`` was)."""
    if not isinstance(stream, CutStream):
        return step(stream)
    return CutStream(list(step(iter(bucket))) for bucket, _ in stream.cuts())


def buckets(stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """``(bucket, is_last)`` over ``stream``: lists of at most ``bucket_bytes`` (a larger
    tensor is its own bucket), cut before the tensor that would overflow; the last bucket is
    marked without reading ahead. An empty stream gives one empty last bucket (a sync of no
    tensors still sends its version). A :class:`CutStream` keeps its own buckets."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if isinstance(stream, CutStream):
        yield from stream.cuts()
        return
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in stream:
        n = nbytes(t)
        if bucket and size + n > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    yield bucket, True


def iter_buckets(stream: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The non-empty buckets of :func:`buckets`."""
    for bucket, _ in buckets(stream, bucket_bytes):
        if bucket:
            yield bucket
