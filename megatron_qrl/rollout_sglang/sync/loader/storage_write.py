"""The direct sync written inside the engine: the trainer's weights, opened here from their
CUDA IPC handles, quantized straight into this engine's live parameters by the direct writer
(:mod:`..writer`).

Runs inside SGLang's scheduler process: the storage service's ``write`` request
(:mod:`.storage`). The direct sync takes this end where the engine's parameters cannot be
handed out: SGLang's memory saver (torch_memory_saver) maps them with ``cuMemCreate``, which
``cudaIpcGetMemHandle`` cannot export, while the trainer's tensors (PyTorch's caching
allocator) can be. The saver keeps each parameter's address across a release / resume, so
the engine's CUDA graphs stay valid and the regions looked up in one sync serve the next.

One sync is one or more ``write`` requests, each carrying up to a bucket of the trainer's
stream: the first (``first``) describes the storage (the regions of earlier syncs kept while
the storage fingerprint holds) and starts a writer; each writes its tensors and waits for
the writes to end (the trainer frees its temporaries after the answer); the last (``last``)
checks that every parameter was written and every weight is finite, and answers the
fingerprints of what was written (``sent``) with the read-back digest of the same regions
(``digest``), which the trainer compares (:func:`..writer.check_digest`), and the seconds
the sync's requests spent here (``loader_s``: the rest of a request's round trip is SGLang's,
the request's way to the scheduler and the trainer's tensors opened from their handles) and
their split by phase (``loader_parts``, :data:`PHASES`). A
request that fails ends the sync: the next must start with ``first``. The trainer's
parameters opened here are kept across syncs where the trainer asks (``keep``) and then sent
by name (``refs``): each handle opened costs ~0.4 ms (:class:`_Held`). Importing this module
loads the writer and the format registry into the engine's process (the storage service
imports it at the first ``write`` request, not at start).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_qrl.sync.protocol.checksums import Checksums, WeightSyncError
from megatron_qrl.sync.protocol.engine_layout import EngineLayout, HeldTensorError

from ..writer import EngineWriter, Places, writer_for
from .live_storage import describe, read_digest

__all__ = ["write"]


@dataclass
class _Storage:
    """One engine's storage as described for a sync, and what the writers looked up in it."""

    layout: EngineLayout
    tensors: dict[str, torch.Tensor]
    places: Places = field(default_factory=Places)
    writer: EngineWriter | None = None
    """The writer of the sync in progress (None between syncs)."""
    seconds: float = 0.0
    """Time spent in this module by the sync in progress (answered by its last request)."""
    parts: dict[str, float] = field(default_factory=dict)
    """``seconds`` by phase (:data:`PHASES`), summed over the sync's requests."""


PHASES = ("describe", "held", "writes", "finish", "sent", "digest")
"""The phases of the engine-side write whose seconds the last request answers
(``loader_parts``): the storage described and a writer made (first request), the held tensors
put back and checked against the trainer's fingerprints, the writes (waited for), the
completeness and finiteness check, the fingerprints of what was written, the read-back
digest. Each ends where the host waits for the device, so a phase holds its GPU time."""


class _Clock:
    """One request's seconds by phase, one reading per phase boundary."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def lap(self, parts: dict[str, float], phase: str) -> float:
        """Add the seconds since the last boundary to ``parts[phase]``; the request's seconds
        so far."""
        now = time.perf_counter()
        parts[phase] = parts.get(phase, 0.0) + now - self.last
        self.last = now
        return now - self.start


_OPEN: dict[int, _Storage] = {}
"""Per engine model (its ``id``; one per scheduler process)."""


@dataclass
class _Held:
    """The trainer's tensors this engine keeps across syncs (opened once from their CUDA IPC
    handles; the trainer then sends their names, ``refs``, while their storage is unchanged:
    :class:`~..transports.direct_pull.HeldTensors` decides)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)
    """Names held or taken to hold by the sync in progress; the rest are dropped at its end."""

    def complete(self, msg: dict, items: Sequence[tuple[str, torch.Tensor]]
                 ) -> list[tuple[str, torch.Tensor]]:
        """The request's items in stream order: ``items`` with the held tensors of
        ``msg["refs"]`` (``[position, name]``, ascending) put back; the received tensors of
        ``msg["keep"]`` held from now on, every other received name dropped. A reference to a
        tensor not held (an engine that lost them), or to one whose fingerprint differs from
        the trainer's (``msg["ref_sums"]``: what is held is not the trainer's memory, e.g. a
        copy), fails the request before anything is written (:class:`HeldTensorError`: the
        sync stays open for the same request sent again with every handle), dropping every
        held tensor."""
        if msg["first"]:
            self.used = set()
            if msg.get("drop_held"):  # the trainer relies on none: let them go now
                self.tensors.clear()
        refs = msg.get("refs", [])
        missing = [n for _, n in refs if n not in self.tensors]
        if missing:
            self.tensors.clear()
            raise HeldTensorError(
                f"direct weight sync: the engine holds no tensor for {missing[0]} "
                f"({len(missing)} sent by name)")
        stale: list[str] = []
        if refs:  # what is held must read what the trainer fingerprinted
            now = Checksums()
            for _, name in refs:
                now.add(name, self.tensors[name])
            stale = [n for n, fp in now.result().items() if msg["ref_sums"].get(n) != fp]
        if stale:  # a copy, not the trainer's memory: what it holds reads old values
            self.tensors.clear()
            raise HeldTensorError(
                f"direct weight sync: the engine's held {stale[0]} no longer reads the trainer's "
                f"tensor ({len(stale)} differ from the trainer's fingerprints)")
        keep = set(msg.get("keep", []))
        for name, t in items:
            if name in keep:
                self.tensors[name] = t
            else:
                self.tensors.pop(name, None)
        full = list(items)
        for i, name in refs:
            full.insert(i, (name, self.tensors[name]))
        self.used |= keep | {n for _, n in refs}
        return full

    def prune(self) -> None:
        """The end of a sync: drop what it neither referenced nor took to hold."""
        self.tensors = {n: t for n, t in self.tensors.items() if n in self.used}


_HELD: dict[int, _Held] = {}
"""Per engine model, apart from :data:`_OPEN` (a storage described anew keeps them)."""


def write(model: torch.nn.Module, msg: dict,
          items: Sequence[tuple[str, torch.Tensor]]) -> dict:
    """One ``write`` request (module docstring): ``msg`` has ``format``, ``first`` and
    ``last``; ``items`` are the trainer's tensors of this request, in stream order."""
    from megatron_qrl.quant import get_spec

    clock = _Clock()
    st = _OPEN.get(id(model))
    if msg["first"]:
        layout, tensors = describe(model)
        if st is None or st.layout.fingerprint != layout.fingerprint:
            st = _OPEN[id(model)] = _Storage(layout, tensors)
        st.writer = writer_for(get_spec(msg["format"]), st.layout, st.tensors, None, st.places)
        st.seconds, st.parts = 0.0, {}
        clock.lap(st.parts, "describe")
    elif st is None or st.writer is None:
        raise WeightSyncError("direct weight sync: a write request that does not start a sync "
                              "came after a failed or finished one; sync again")
    w = st.writer
    # before the writer is touched: a HeldTensorError leaves the sync open for the same
    # request sent again with every handle
    items = _HELD.setdefault(id(model), _Held()).complete(msg, items)
    clock.lap(st.parts, "held")
    try:
        for name, t in items:
            w.write(name, t)
        if w.device.type == "cuda":  # the trainer frees these tensors after the answer
            torch.cuda.synchronize(w.device)
        if not msg["last"]:
            st.seconds += clock.lap(st.parts, "writes")
            return {"written": len(items)}
        clock.lap(st.parts, "writes")
        w.finish()
        _HELD[id(model)].prune()
        clock.lap(st.parts, "finish")
        sent = w.sent.result()
        clock.lap(st.parts, "sent")
        out = {"sent": sent, "digest": read_digest(st.layout, st.tensors, w.shapes),
               "quantized": w.quantized, "copied": w.copied}
        seconds = st.seconds + clock.lap(st.parts, "digest")
        return {**out, "loader_s": seconds, "loader_parts": dict(st.parts)}
    except BaseException:
        st.writer = None
        raise
    finally:
        if msg["last"]:
            st.writer = None
