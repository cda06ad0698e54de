"""The direct writer: the trainer's weights quantized straight into the engine's own tensors.

Runs where the writes are made: in the trainer's process, into the engine's storage
(:mod:`.loader.live_storage`: its live parameters in their checkpoint views, through CUDA IPC
handles), or, where the engine's storage cannot be shared (its memory saver), inside the
engine's scheduler from the trainer's weights opened there (:mod:`.loader.storage_write`).
The engine's storage and its layout (:mod:`megatron_qrl.sync.protocol.engine_layout`) say
where each packed tensor of ``QuantSpec.pack_state_dict`` goes: q/k/v into their rows of ``qkv_proj``, gate/up into
``gate_up_proj`` and into the halves of ``w13_*``, experts (one by one or stacked
``[E, ...]``) into their index of the stacked parameter, block scales into their block rows.

The writer takes the stream :func:`~megatron_qrl.quant.pack_stream.writer_stream` makes (the
driver's, where the engine :attr:`~megatron_qrl.rollout.base.RolloutEngine.quantizes_into`):

* a weight the format quantizes, still in high precision (``[out, in]``, or a layer's expert
  stack ``[E, out, in]``): ``QuantSpec.quantize_into`` computes its scales and writes scales
  and codes straight into their engine regions — no packed tensor of the weight, no second
  copy, no bucket, no request;
* a packed tensor (codes and scales the aligned forward's Q(W) cache already holds,
  :mod:`megatron_qrl.rl.qcache_sync`; or a whole packed stream, ``pack_state_dict``): one
  device copy into its region, no quantization;
* a tensor the format leaves in high precision (norms, embeddings, the router): one copy.

Fingerprints are taken in the same pass (:class:`~megatron_qrl.sync.protocol.checksums.
Checksums`, an expert stack's experts under their own names as the in-place sender takes
them): of the packed tensor copied (the cache's own tensors, where it held them), or of the
region a quantization wrote; the engine's read-back (:func:`check_digest`) names the first
region that differs.

Where the engine keeps a parameter in SGLang's Marlin layout (``w4a16``:
:attr:`~megatron_qrl.sync.protocol.engine_layout.ParamLayout.marlin`), a weight is quantized
by the format's reference quantizer (or taken from the Q(W) cache) and each packed tensor is
written through :func:`~megatron_qrl.sync.protocol.marlin.to_live` (codes repacked, scales
transposed and permuted) into its live region; fingerprints stay those of the packed
tensors (the read-back undoes the layout); ``weight_shape`` is the engine's own and is not
written.

Which formats: those whose :attr:`~megatron_qrl.quant.engine_facts.EngineFacts.direct_write`
says the engine's live layout is the packed one or one the writer produces (:func:`writer_for`).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from typing import NamedTuple

import torch

from megatron_qrl.sync.protocol.checksums import Checksums, WeightSyncError
from megatron_qrl.sync.protocol.engine_layout import EngineLayout, EngineLayoutError, locate, view
from megatron_qrl.sync.protocol.inplace import expert_names
from megatron_qrl.sync.protocol.marlin import to_live
from megatron_qrl.utils import hf_names

from ...quant.expert_stacks import stack_rows
from ...quant.finite_checks import FiniteChecks
from ...quant.spec import QuantSpec
from ...quant.stacked import can_stack, quantize_stacks, split_stack

__all__ = ["EngineWriter", "Places", "check_digest", "writer_for"]

FLAG = "--qrl-rollout-sglang-sync direct"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def writer_for(spec: QuantSpec, layout: EngineLayout, tensors: dict[str, torch.Tensor],
               sent: Checksums | None = None, places: Places | None = None) -> EngineWriter:
    """The direct writer of format ``spec`` into one engine's storage; a format whose engine
    layout is not its packed layout is one error naming the flag. ``places``: the regions of
    earlier syncs into the same storage (:class:`Places`), or None (looked up anew)."""
    if not spec.engine.direct_write:
        ok = sorted(_direct_formats())
        raise ValueError(f"{FLAG}: format {spec.name!r} is re-processed by the engine after "
                         f"loading (its live layout is not the packed one); direct writes "
                         f"serve {ok}; use --qrl-rollout-sglang-sync inplace")
    return EngineWriter(spec, layout, tensors, Checksums() if sent is None else sent,
                        Places() if places is None else places)


class Places:
    """What the writer looked up by name in one engine storage, kept across syncs (the
    layout and the tensors do not change while the handles hold: the caller drops it with
    them, :class:`~.storage_client.EngineStorage`): per packed tensor its region
    (:func:`~megatron_qrl.sync.protocol.engine_layout.locate` + ``view``, the names of a
    stack's experts), per stream name how it is written. A sync then costs a dict look-up per
    tensor instead of parsing its name."""

    def __init__(self) -> None:
        self.owner: tuple[object, object, str] | None = None
        self.regions: dict[tuple[str, tuple[int, ...]], _Region] = {}
        self.kinds: dict[str, str] = {}
        """Stream name -> ``quantize`` / ``marlin`` / ``copy`` (a float tensor's)."""

    def of(self, spec: QuantSpec, layout: EngineLayout, tensors: dict) -> Places:
        """These places, emptied where they were looked up in another storage or format."""
        owner = (layout, tensors, spec.name)
        if self.owner is None or any(a is not b for a, b in zip(self.owner, owner)):
            self.owner, self.regions, self.kinds = owner, {}, {}
        return self


class _Region(NamedTuple):
    param: str
    dst: torch.Tensor
    experts: list[str] | None
    """A stack's experts' names (fingerprinted one by one), or None."""


def _direct_formats() -> list[str]:
    from ...quant import get_spec, list_specs

    return [n for n in list_specs() if get_spec(n).engine.direct_write]


class EngineWriter:
    """Quantizes or copies a stream into an engine's storage and fingerprints what it wrote
    (module doc)."""

    def __init__(self, spec: QuantSpec, layout: EngineLayout, tensors: dict[str, torch.Tensor],
                 sent: Checksums, places: Places | None = None):
        self.spec, self.layout, self.tensors, self.sent = spec, layout, tensors, sent
        self.places = (places or Places()).of(spec, layout, tensors)
        self.device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self.shapes: dict[str, list[int]] = {}
        """Packed name -> shape of every tensor written (the read-back's request)."""
        self.written: dict[str, int] = {}
        """Engine parameter -> elements written this sync."""
        self.finite = FiniteChecks()
        """The finiteness of every weight quantized, as device bools: checked once
        (:meth:`write_all`)."""
        self.quantized = self.copied = self.kept = 0
        """Weights (or expert stacks) quantized into the engine / tensors copied, this sync."""
        self.seconds = 0.0

    def write(self, name: str, t: torch.Tensor) -> None:
        """Quantize weight ``name`` into its engine regions, or copy tensor ``name`` into its
        region (module doc)."""
        t = t.detach().to(self.device, non_blocking=True)
        kind = self.places.kinds.get(name) if t.dtype in _FLOATS else "copy"
        if kind is None:
            kind = self.places.kinds[name] = self._kind(name)
        if kind == "copy":
            self._copy(name, t)
            self.copied += 1
            return
        if kind == "marlin":  # the format's quantizer, then the packed tensors' path
            p = hf_names.parse(name)
            if p is not None and p.is_stacked:
                self._marlin_stack(name, t)
            else:
                for packed, x in self.spec.pack_quantized(name, self.spec.quantize_weight(
                        t, name=name, finite=self.finite)):
                    self._copy(packed, x)
        else:
            for packed, dst in self.spec.quantize_into(name, t, self._region, self.finite):
                self._record(packed, dst, kept=True)
        self.quantized += 1

    def _marlin_stack(self, name: str, t: torch.Tensor) -> None:
        """Expert stack ``name`` ``[E, out, in]`` into a Marlin-layout parameter: quantized as
        row-concatenated runs of experts (:func:`~megatron_qrl.quant.stacked.quantize_stacks`,
        each expert's bits as if alone), each packed kind written as one stack (one layout
        change and one fingerprint launch per kind, not one per expert)."""
        names = [hf_names.expert_name(name, e) for e in range(t.shape[0])]
        experts = list(t.unbind(0))
        spec = self.spec
        packed: list[list[tuple[str, torch.Tensor]]] = []
        if can_stack(spec, experts):
            for q, rows in quantize_stacks(spec, experts, name=name, finite=self.finite,
                                           names=names):
                chunk = names[len(packed):len(packed) + len(rows)]
                packed += spec.pack_stacked(chunk, q, rows) or [
                    spec.pack_quantized(n, w) for n, w in zip(chunk, split_stack(spec, q, rows))]
        else:  # (a stack of one expert)
            packed = [spec.pack_quantized(n, spec.quantize_weight(w, name=n, finite=self.finite))
                      for n, w in zip(names, experts)]
        for j, (first, _) in enumerate(packed[0]):
            stacked = str(hf_names.parse(first)._replace(expert=hf_names.STACKED))
            self._copy(stacked, stack_rows([tensors[j][1] for tensors in packed]))

    def _kind(self, name: str) -> str:
        """How float tensor ``name`` is written: ``quantize`` (into its regions), ``marlin``
        (quantized, then its packed tensors through the Marlin layout) or ``copy``."""
        if not _quantized_weight(self.spec, name):
            return "copy"
        codes = f"{name[: -len('.weight')]}.{self.spec._packed_suffixes()[0]}"
        return "marlin" if self.layout.params[locate(self.layout, codes).param].marlin \
            else "quantize"

    def _copy(self, name: str, t: torch.Tensor) -> None:
        """One packed (or high-precision) tensor into its region, through the Marlin layout
        where the engine keeps one; fingerprinted as sent (a cached code: the cache's)."""
        if self._kept(name):
            self.kept += 1
            return
        dst = self._region(name, tuple(t.shape), t.dtype)
        src = t.contiguous()
        kind = self.layout.params[self.places.regions[name, tuple(t.shape)].param].marlin
        dst.copy_(to_live(kind, src) if kind else src, non_blocking=True)
        self._record(name, src)

    def _kept(self, name: str) -> bool:
        """``name`` is a ``weight_shape`` of a Marlin-layout weight: the engine keeps its own
        (SGLang does not read it after loading) and the codes' region checks the shape."""
        if not name.endswith(".weight_shape"):
            return False
        return bool(self.layout.params[locate(self.layout, name.removesuffix(
            "_shape") + "_packed").param].marlin)

    def _region(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The engine region packed tensor ``name`` of ``shape`` occupies; it must hold
        ``dtype`` and must not have been written before in this sync."""
        if name in self.shapes:
            raise WeightSyncError(f"tensor {name!r} was sent twice in one weight sync")
        r = self.places.regions.get((name, shape))
        if r is None:
            r = self._look_up(name, shape)
        if r.dst.dtype != dtype:
            raise EngineLayoutError(f"direct weight sync: {name} is {dtype}, the engine holds "
                                    f"{r.param} as {r.dst.dtype}; the engine was started "
                                    "for another format")
        self.shapes[name] = list(shape)
        self.written[r.param] = self.written.get(r.param, 0) + r.dst.numel()
        return r.dst

    def _look_up(self, name: str, shape: tuple[int, ...]) -> _Region:
        """:class:`_Region` of packed tensor ``name`` (raises where the engine has none),
        remembered in :attr:`places`."""
        target = locate(self.layout, name)
        dst = view(self.tensors[target.param], self.layout.params[target.param], target, shape)
        p = hf_names.parse(name)
        experts = expert_names(name, dst.shape[0]) if p is not None and p.is_stacked else None
        r = self.places.regions[name, shape] = _Region(target.param, dst, experts)
        return r

    def _record(self, name: str, t: torch.Tensor, kept: bool = False) -> None:
        """Fingerprint ``t`` (an expert stack per expert); ``kept``: ``t`` is its engine
        region (held by the fingerprints at no cost until they are taken)."""
        r = self.places.regions[name, tuple(t.shape)]
        if r.experts is not None:
            self.sent.add_rows(r.experts, t, kept=kept)
        else:
            self.sent.add(name, t, kept=kept)

    def write_all(self, stream: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write every tensor of ``stream``; then every engine parameter must have been
        written (all of it, but a plain parameter's padding), and every weight quantized
        finite (one host sync; a non-finite one raises naming it, the engine then holds a
        partial update and keeps its old weight version). Returns the tensors written."""
        t0 = time.perf_counter()
        n = 0
        for name, t in stream:
            self.write(name, t)
            n += 1
        self.finish()
        self.seconds += time.perf_counter() - t0
        return n

    def finish(self) -> None:
        """The end of a sync's writes: the regions' fingerprints taken (one launch, before the
        engine reads), every weight finite (one host sync), every parameter written."""
        self.sent.flush()
        self.finite.check(self.spec)  # (the driver refused non-finite weights before)
        self.check_complete()

    def check_complete(self) -> None:
        for param, pl in self.layout.params.items():
            got, full = self.written.get(param, 0), math.prod(pl.shape)
            fused = pl.experts or pl.shards
            if got == 0 or (fused and got != full):
                raise WeightSyncError(
                    f"direct weight sync: engine parameter {param} got {got} of {full} "
                    "elements (a tensor of the model is missing from the stream); the engine "
                    "now holds a partial update — sync again")


def _quantized_weight(spec: QuantSpec, name: str) -> bool:
    """``name`` is a weight (or expert stack) the format quantizes."""
    p = hf_names.parse(name)
    return spec.is_quantized(hf_names.expert_name(name, 0) if p is not None and p.is_stacked
                             else name)


def check_digest(sent: dict[str, str], held: dict[str, str]) -> None:
    """Raise :class:`WeightSyncError` on the first written region the engine holds
    differently (naming its decoder layer), or that it did not read back."""
    for name, want in sent.items():
        got = held.get(name)
        if got == want:
            continue
        m = _LAYER.search(name)
        where = f"layer {m[1]}" if m else "outside the decoder layers"
        raise WeightSyncError(
            f"direct weight sync: the engine holds a different {name!r} ({where}) than "
            f"written: wrote {want}, engine read back {got}")
