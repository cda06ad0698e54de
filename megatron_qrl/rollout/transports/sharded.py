"""Transport ``sharded`` (side ``fleet``): one sender's part of a sync from trainer EP > 1
ranks (:mod:`megatron_qrl.rollout.weight_groups` for the groups and the receiving side).

A sender sends its non-expert segment (empty but for sender 0), then one segment per
decoder layer of its experts, each cut into buckets by the one rule and framed as
:mod:`.broadcast` frames them (each segment ends with ``(0, 0)``), then the end-of-stream
mark. The stream sends non-expert tensors first and each layer's experts together
(:func:`megatron_qrl.rl.ep_send.sharded_hf_stream` does); a segment that comes back is
one error."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import groupby
from typing import Any

import torch

from ...sync.transport import Bucket, cut, register_transport
from ..weight_groups import segment_key, send_stream_end
from .broadcast import FramedTransport

__all__ = ["SegmentTransport", "send_segments"]


@register_transport("fleet", "sharded")
class SegmentTransport(FramedTransport):
    """Frames cut per segment, then the end-of-stream mark (module docstring)."""

    def cuts(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[Bucket, bool]]:
        """Each segment cut on its own (``last``: the segment's last bucket)."""
        seen: set[str] = set()
        first = True
        for key, items in groupby(stream, key=lambda item: segment_key(item[0])):
            if key in seen or (key == "" and not first):
                raise ValueError(f"sharded weight stream: segment {key or 'non-expert'!r} "
                                 "comes back after the stream moved on; send the non-expert "
                                 "tensors first and each layer's experts together")
            if first and key != "":
                yield from cut(iter(()), self.bucket_bytes)  # no non-expert tensors
            first = False
            seen.add(key)
            yield from cut(items, self.bucket_bytes)
        if first:
            yield from cut(iter(()), self.bucket_bytes)

    def finish(self, version: int) -> None:
        send_stream_end(self.group, self.device)


def send_segments(stream: Iterable[tuple[str, torch.Tensor]], group: Any,
                  device: torch.device | str, bucket_bytes: int) -> int:
    """A sender's side of a sharded sync on ``group`` (module docstring); returns the
    buckets sent."""
    return SegmentTransport(group, str(device), bucket_bytes).send(stream, 0)
