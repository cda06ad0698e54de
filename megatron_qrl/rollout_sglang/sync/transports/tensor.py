"""Transport ``tensor``: buckets of packed tensors through SGLang's
``update_weights_from_tensor`` and its plain ``model.load_weights`` (bf16, and formats
whose loaded layout equals the checkpoint's). With ``prefetch_buckets`` the next buckets
are prepared in a thread (:func:`~..prefetch.ahead`) while the engine loads one; the
requests stay in order, in this thread."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megatron_qrl.sync.protocol.checksums import WeightSyncError
from megatron_qrl.sync.transport import WeightTransport, register_transport

from ..sender import StreamTracker, requests
from ..session import SGLangSession

__all__ = ["TensorTransport"]


@register_transport("sglang", "tensor")
class TensorTransport(WeightTransport):
    """Plain tensors to SGLang's own loader (module docstring)."""

    load_format: str | None = None
    """The request's ``load_format`` (None: SGLang's ``model.load_weights``)."""

    def __init__(self, session: SGLangSession):
        self.s = session
        self.bucket_bytes = session.bucket_bytes
        self.tracker: StreamTracker | None = None

    def produce(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Any]:
        """``(tensors of one request, first name, last)`` per bucket
        (:func:`~..sender.requests`: fingerprints, expert stacks, the one bucketing rule),
        prepared ahead in a thread with ``prefetch_buckets``."""
        from ..prefetch import ahead, timed

        s, opts = self.s, self.s.options
        init = (lambda: torch.cuda.set_device(s.device)) if s.device.type == "cuda" else None
        produced = requests(stream, s.sent, self.tracker, s.device, bucket_bytes=self.bucket_bytes,
                            flat=opts.flat_buckets, stack=opts.stack_experts, lap=s.lap)
        s.lap.setdefault("serialize_s", 0.0)
        return timed(ahead(timed(produced, s.lap, "produce_s"), opts.prefetch_buckets, init),
                     s.lap, "wait_s")

    def send_bucket(self, item: tuple[list, str, bool]) -> int:
        import time

        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        items, first, last = item
        t0 = time.perf_counter()
        payload = self.s.serialize(items)
        self.s.lap["serialize_s"] += time.perf_counter() - t0
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payload, load_format=self.load_format, flush_cache=last,
            weight_version=str(self.version) if last else None)
        ok, msg = self.s.request("update_weights_from_tensor", req, first)
        if not ok:
            raise WeightSyncError(f"SGLang rejected a weight bucket ({first} ...): {msg}")
        self.s.lap["buckets"] += 1
        return 1

    def prepare(self, version: int) -> None:
        self.version = version
