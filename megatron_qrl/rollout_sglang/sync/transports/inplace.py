"""Transport ``inplace`` (the default for formats that quantize weights): the buckets of
:mod:`.tensor` with ``load_format`` = our registered loader (:mod:`..loader`), which
rebuilds each quantized layer's checkpoint parameters, re-runs its post-load processing
(Marlin repacking, transposes) and copies the result into the live tensors, so CUDA graphs
stay valid. Each bucket carries a control tensor naming its complete modules
(:class:`~..sender.StreamTracker`); with ``receipt`` every scheduler process fingerprints
what it received, checked in :meth:`InplaceTransport.verify`."""

from __future__ import annotations

from megatron_qrl.sync.protocol.inplace import LOADER
from megatron_qrl.sync.transport import register_transport

from ..sender import StreamTracker, check_receipts, packed_suffixes
from .tensor import TensorTransport

__all__ = ["InplaceTransport"]


@register_transport("sglang", "inplace")
class InplaceTransport(TensorTransport):
    """Buckets to our in-place loader, with control tensors and receipts."""

    load_format = LOADER

    def prepare(self, version: int) -> None:
        super().prepare(version)
        s = self.s
        self.tracker = StreamTracker(packed_suffixes(s.spec),
                                     direct_experts=s.options.direct_expert_loads,
                                     receipt=s.receipt)

    def verify(self, sent: dict[str, str]) -> dict[str, str] | None:
        return check_receipts(self.s.receipt, sent, self.s.processes) if self.s.receipt else None
