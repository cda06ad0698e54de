"""The trainer's side of a bucketed SGLang sync: fingerprints, expert stacks, buckets.

Runs in the trainer's process (in :func:`~.prefetch.ahead`'s thread when buckets are
prefetched). The packed ``(hf_name, tensor)`` stream becomes requests of about
``bucket_bytes`` (:func:`megatron_qrl.sync.protocol.wire.buckets`, the one bucketing rule;
a stream that arrives cut — a Ray engine actor's, :class:`~megatron_qrl.sync.protocol.wire.
CutStream` — keeps the driver's buckets, the steps below running inside each):

1. optionally each decoder layer's experts of one kind are stacked into one wire tensor
   (:func:`~megatron_qrl.quant.expert_stacks.stack_experts`; names in :mod:`.protocol`) — a
   stream that arrives stacked (``QuantSpec.pack_state_dict(stack_experts=True)``, the
   packed experts' rows without per-expert copies) passes through;
2. every tensor goes to the trainer's device and is fingerprinted (:class:`Checksums`;
   a stack's experts as rows of the stack, equal bit for bit to one by one:
   :func:`~megatron_qrl.sync.protocol.checksums.checksum_rows`);
3. in-place buckets name their complete modules in a control tensor
   (:class:`StreamTracker`) and travel either as one flat ``uint8`` buffer per bucket or per
   tensor with 1-byte floats as ``uint8`` (:func:`megatron_qrl.sync.protocol.wire.as_bytes`).
"""

from __future__ import annotations

import glob
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_qrl.sync.protocol.checksums import Checksums, WeightManifest, WeightSyncError
from megatron_qrl.sync.protocol.inplace import (
    CONTROL,
    FLAT,
    RECV,
    InplaceSyncError,
    encode_control,
    expert_names,
    expert_views,
    module_key,
    parse_stacked,
)
from megatron_qrl.sync.protocol.wire import as_bytes, buckets, flatten, per_bucket

from ...quant.expert_stacks import stack_experts

__all__ = ["StreamTracker", "check_receipts", "fingerprinted", "packed_suffixes", "requests",
           "stack_experts"]


def packed_suffixes(spec) -> tuple[str, ...]:
    """The tensor suffixes ``spec`` packs a quantized linear into (``weight``,
    ``weight_scale``, ...), read off :meth:`QuantSpec.packed_names`."""
    probe = "model.layers.0.self_attn.o_proj.weight"
    if not spec.is_quantized(probe):
        return ()
    mod = probe.rpartition(".")[0]
    return tuple(n[len(mod) + 1:] for n in spec.packed_names(probe))


@dataclass
class StreamTracker:
    """Which modules of a packed stream are complete, and the control tensor saying so.

    The stream must send each module's tensors contiguously (``pack_state_dict`` does: q/k/v
    and an expert's gate/up/down are adjacent); a module that reappears is an error."""

    suffixes: tuple[str, ...] = ()
    """Checkpoint tensor suffixes of the format (``weight``, ``weight_scale``, ...): every
    reloaded parameter with one of these names must receive all its shards."""
    direct_experts: bool = False
    """Ask the loader to put expert tensors straight into their ``FusedMoE`` parameters
    (:mod:`.loader.experts`) instead of through ``model.load_weights``."""
    receipt: str | None = None
    """Path prefix where each engine process writes the fingerprints of what it received
    (:mod:`.loader.receipt`); None: no receipt."""
    current: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)
    done: dict[str, int] = field(default_factory=dict)
    views: dict[str, str] = field(default_factory=dict)
    begun: bool = False

    def send_as(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The tensor to put in a per-tensor bucket: a 1-byte float as its ``uint8`` view,
        re-viewed by the loader (a flat bucket's meta names each dtype instead)."""
        raw, dtype = as_bytes(t)
        if dtype is not None:
            self.views[name] = dtype
        return raw

    def add(self, name: str) -> None:
        key = module_key(name)
        if key != self.current:
            if key in self.closed:
                raise InplaceSyncError(
                    f"in-place sync: tensor {name!r} of module {key!r} arrives after the "
                    "stream moved on to other modules; send each module's tensors together")
            self._close()
            self.current = key
        self.counts[key] = self.counts.get(key, 0) + 1

    def _close(self) -> None:
        if self.current is not None:
            self.closed.add(self.current)
            self.done[self.current] = self.counts[self.current]
        self.current = None

    def control(self, final: bool) -> torch.Tensor:
        """The control tensor for the bucket about to be sent (takes the done modules)."""
        if final:
            self._close()
        msg = {"begin": not self.begun, "final": final, "done": self.done,
               "suffixes": list(self.suffixes), "views": self.views,
               "direct_experts": self.direct_experts, "receipt": self.receipt}
        self.begun, self.done, self.views = True, {}, {}
        return encode_control(msg)


# ---- fingerprints and requests -------------------------------------------------------
def fingerprinted(stream: Iterable[tuple[str, torch.Tensor]], sent: Checksums,
                  device: torch.device, lap: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` moved to ``device``, each tensor fingerprinted into ``sent`` under its
    stream name (a stack's experts under their own names, as rows)."""
    lap.setdefault("fingerprint_s", 0.0)
    for name, t in stream:
        t0 = time.perf_counter()
        t = t.detach().to(device, non_blocking=True).contiguous()
        if parse_stacked(name) is None:
            sent.add(name, t)
        else:
            if t.dim() == 0:
                expert_views(name, t)  # raises, naming the tensor
            sent.add_rows(expert_names(name, t.shape[0]), t)
        lap["fingerprint_s"] += time.perf_counter() - t0
        yield name, t


def requests(stream: Iterable[tuple[str, torch.Tensor]], sent: Checksums,
             tracker: StreamTracker | None, device: torch.device, *, bucket_bytes: int,
             flat: bool = False, stack: bool = False, rows: bool = True,
             lap: dict | None = None) -> Iterator[tuple[list, str, bool]]:
    """``(tensors of one request, its first name, last)`` per bucket of ``stream``.

    ``tracker``: an in-place sync (control tensors, ``flat`` buckets, ``stack`` experts);
    None: plain tensors for SGLang's own loader. ``rows`` False fingerprints each expert
    before stacking (the older order; ``bench/weight_sync.py`` times both; the
    fingerprints are equal). ``lap`` gains ``stream_s`` (waiting on the packed stream),
    ``fingerprint_s`` and ``flatten_s``."""
    from .prefetch import timed

    lap = {} if lap is None else lap
    stack = bool(tracker) and stack

    def wire_of(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        wire = timed(stream, lap, "stream_s")
        if stack and rows:
            wire = stack_experts(wire)
        wire = fingerprinted(wire, sent, device, lap)
        return stack_experts(wire) if stack and not rows else wire

    for bucket, last in buckets(per_bucket(stream, wire_of), bucket_bytes):
        if tracker:
            for name, _ in bucket:
                tracker.add(name)
            if not flat:
                bucket = [(n, tracker.send_as(n, t)) for n, t in bucket]
        yield _request_items(bucket, tracker, device, last, flat, lap)


def _request_items(bucket: list, tracker: StreamTracker | None, device: torch.device,
                   last: bool, flat: bool, lap: dict) -> tuple[list, str, bool]:
    items = bucket
    if tracker and flat and bucket:
        t0 = time.perf_counter()
        buf, meta = flatten(bucket)
        items = [(RECV, encode_control({"meta": meta}).to(device)), (FLAT, buf)]
        lap["flatten_s"] = lap.get("flatten_s", 0.0) + time.perf_counter() - t0
    if tracker:
        items = items + [(CONTROL, tracker.control(final=last).to(device))]
    return items, bucket[0][0] if bucket else "end of sync", last


def check_receipts(prefix: str, sent: dict[str, str], processes: int) -> dict[str, str]:
    """Compare every engine process's receipt (``<prefix>.<pid>.json``, written by
    :mod:`.loader.receipt`) with the fingerprints of the sent stream; returns what the
    engine received. Raises :class:`WeightSyncError` naming the first tensor missing,
    different, unexpected or held differently, or a missing receipt. The files are removed."""
    files = sorted(glob.glob(f"{glob.escape(prefix)}.*.json"))
    try:
        receipts = [json.loads(Path(f).read_text()) for f in files]
    finally:
        for f in files:
            Path(f).unlink(missing_ok=True)
    if len(receipts) != processes:
        raise WeightSyncError(f"{len(receipts)} of the engine's {processes} scheduler "
                              "process(es) reported what they received; the in-place loader "
                              "did not finish the sync")
    manifest = WeightManifest(dict(sent))
    for rec in receipts:
        got = rec["received"]
        manifest.compare(got)
        extra = next((n for n in got if n not in sent), None)
        if extra is not None:
            raise WeightSyncError(f"engine received tensor {extra!r}, which was not sent")
        for name, held in rec["held"].items():
            if held != got[name]:
                raise WeightSyncError(f"engine holds a different {name!r} after loading: "
                                      f"received {got[name]}, holds {held}")
    return receipts[0]["received"]
