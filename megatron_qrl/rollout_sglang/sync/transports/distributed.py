"""Transport ``distributed``: the engine runs on other GPUs (``base_gpu``) and every bucket
is broadcast from the trainer's device over the engine's weight-update group
(:mod:`..distributed`) while the engine's request waits: our loader's request for
quantized formats (with the receipt, checked in :meth:`DistributedTransport.verify`),
SGLang's own ``update_weights_from_distributed(load_format="flattened_bucket")`` for bf16."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial

import torch

from megatron_qrl.sync.protocol.checksums import WeightSyncError
from megatron_qrl.sync.protocol.inplace import CONTROL, LOADER, RECV, encode_control
from megatron_qrl.sync.transport import WeightTransport, register_transport

from ..distributed import flat_buckets, run_alongside, send_bucket
from ..sender import StreamTracker, check_receipts, packed_suffixes
from ..session import SGLangSession

__all__ = ["DistributedTransport"]


@register_transport("sglang", "distributed")
class DistributedTransport(WeightTransport):
    """Flat buckets broadcast under the engine's request (module docstring)."""

    def __init__(self, session: SGLangSession):
        self.s = session
        self.bucket_bytes = session.bucket_bytes

    def prepare(self, version: int) -> None:
        s = self.s
        self.version, self.group = version, s.weight_group()
        self.tracker = (StreamTracker(packed_suffixes(s.spec), receipt=s.receipt)
                        if s.spec.quantizes_weights else None)

    def produce(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple]:
        """``(names, flat buffer, meta, last)`` per non-empty bucket
        (:func:`~..distributed.flat_buckets`, the one bucketing rule)."""
        return flat_buckets(self.s.sent.passing(stream), self.bucket_bytes, self.s.device)

    def send_bucket(self, item: tuple) -> int:
        from sglang.srt.managers.io_struct import (
            UpdateWeightsFromDistributedReqInput,
            UpdateWeightsFromTensorReqInput,
        )

        names, flat, meta, last = item
        s, tracker, group = self.s, self.tracker, self.group
        wv = str(self.version) if last else None
        if tracker:
            for n in names:
                tracker.add(n)
            small = [(RECV, encode_control({"group": group.name, "meta": meta}).cuda()),
                     (CONTROL, tracker.control(final=last).cuda())]
            req = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=s.serialize(small), load_format=LOADER,
                flush_cache=last, weight_version=wv)
        else:
            req = UpdateWeightsFromDistributedReqInput(
                names=names, dtypes=[d for _, d, _ in meta], shapes=[sh for _, _, sh in meta],
                group_name=group.name, flush_cache=last, weight_version=wv,
                load_format="flattened_bucket")
        send = "update_weights_from_tensor" if tracker else "update_weights_from_distributed"
        ok, msg = run_alongside(partial(s.request, send, req, names[0]),
                                partial(send_bucket, flat, group))
        if not ok:
            raise WeightSyncError(f"SGLang rejected a broadcast weight bucket ({names[0]} ...): {msg}")
        s.lap["buckets"] += 1
        return 1

    def verify(self, sent: dict[str, str]) -> dict[str, str] | None:
        return check_receipts(self.s.receipt, sent, self.s.processes) if self.s.receipt else None
