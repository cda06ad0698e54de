"""The finiteness of a stream's weights, checked once at its end instead of once per weight.

Quantizing a weight reduces its amaxes anyway; the weight is finite iff they are (a max
propagates NaN and Inf: :meth:`~megatron_qrl.quant.spec_core.SpecCore._check_finite_amax`).
Checking that on the host costs one device->host sync per weight, and on a GPU each sync
drains the queue: the host cannot queue the next weight's kernels while the device works.
A stream (the weight sync's :func:`~megatron_qrl.quant.pack_stream.pack_state_dict`, the
direct writer's :meth:`~megatron_qrl.quant.spec_core.SpecCore.quantize_into`) hands its
quantizers one :class:`FiniteChecks` instead: each weight adds a device bool per row (or
per block row) of its amaxes (of the weight itself where the torch reference quantizes), and
:meth:`FiniteChecks.check` reads them all with one host sync (one per device), raising
:class:`~megatron_qrl.utils.finite.NonFiniteError` naming the first weight that held a NaN /
Inf (the first added, or the first in the stream's order where that differs). A caller that
quantizes one weight passes none and is checked at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..utils.finite import NonFiniteError

__all__ = ["FiniteChecks"]

FIX = "the checkpoint or the last optimizer step is broken"


@dataclass
class FiniteChecks:
    """Device bools of the weights quantized so far, checked by :meth:`check` (module doc).

    ``entries``: ``(names, rows, ok)`` per quantizer call, ``ok`` 1-D along the rows of what
    was quantized; ``rows`` None for one weight, else the row counts of the weights ``names``
    whose row-concatenation it was (:meth:`stack`)."""

    entries: list[tuple[tuple[str, ...], tuple[int, ...] | None, torch.Tensor]] = field(
        default_factory=list)
    _stack: tuple[tuple[str, ...], tuple[int, ...]] | None = None

    def add(self, name: str, ok: torch.Tensor) -> None:
        """Weight ``name`` is finite where ``ok`` (a bool tensor whose first dimension runs
        along the weight's rows or block rows, or a scalar) is all True. No host sync."""
        names, rows = self._stack or ((name,), None)
        self.entries.append((names, rows, _along_rows(ok)))

    def add_amax(self, name: str, a: torch.Tensor) -> None:
        """Weight ``name`` is finite where its amaxes ``a`` (a float tensor reduced over all of
        it, made for this record: held, unchanged, until :meth:`check`) are: no op now — the
        amaxes of all weights are checked by one ``isfinite`` in :meth:`check`."""
        names, rows = self._stack or ((name,), None)
        self.entries.append((names, rows, a))

    def stack(self, names: Sequence[str], rows: Sequence[int]) -> FiniteChecks:
        """The checks of one row-stack of weights ``names`` (``rows[i]`` rows each; every
        weight's rows a whole number of ``ok``'s units): what a quantizer called on the stack
        adds is recorded for these names, so a bad row names its own weight."""
        return FiniteChecks(self.entries, (tuple(names), tuple(rows)))

    def check(self, spec, order: Mapping[str, int] | None = None) -> None:
        """Raise :class:`NonFiniteError` naming the first weight that held a NaN / Inf
        (``"{spec.name}: {weight} holds NaN / Inf values; ..."``): the first added, or with
        ``order`` (weight -> position in the stream) the first in the stream. One host sync
        per device the weights were on (none without entries)."""
        first = self.first_bad(order)
        if first is not None:
            raise NonFiniteError(f"{spec.name}: {first} holds NaN / Inf values; {FIX}")

    def first_bad(self, order: Mapping[str, int] | None = None) -> str | None:
        """The first weight that held a NaN / Inf (as :meth:`check` names it), or None: one
        host sync per device the weights were on (none without entries)."""
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for *_, ok in self.entries:  # (bools, amaxes) per device, amaxes: one isfinite
            by_device.setdefault(ok.device, ([], []))[ok.dtype != torch.bool].append(
                ok.reshape(-1))
        if all(_all_finite(flags, amaxes) for flags, amaxes in by_device.values()):
            return None
        bad = self.bad_weights()
        return bad[0] if order is None else min(bad, key=lambda n: order.get(n, -1))

    def bad_weights(self) -> list[str]:
        """The weights that held a NaN / Inf, in the order added (host syncs: the error
        path)."""
        bad: list[str] = []
        for names, rows, ok in self.entries:
            ok = ok if ok.dtype == torch.bool else _along_rows(torch.isfinite(ok))
            if bool(ok.all()):
                continue
            if rows is None:
                bad.append(names[0])
                continue
            unit = sum(rows) // ok.numel()  # rows per element of ok
            ends = torch.tensor(rows).cumsum(0)
            at = torch.searchsorted(ends, (~ok).nonzero()[:, 0].cpu() * unit, right=True)
            bad += [names[i] for i in at.unique().tolist()]
        return bad


def _along_rows(ok: torch.Tensor) -> torch.Tensor:
    """``ok`` 1-D along its first dimension (all True across the others); a scalar as one."""
    return ok.reshape(1) if ok.dim() == 0 else ok.flatten(1).all(dim=1) if ok.dim() > 1 else ok


def _all_finite(flags: list[torch.Tensor], amaxes: list[torch.Tensor]) -> bool:
    """All ``flags`` True and all ``amaxes`` finite (1-D tensors of one device): one host sync."""
    parts = ([torch.cat(flags)] if flags else []) + (
        [torch.isfinite(torch.cat(amaxes))] if amaxes else [])
    return bool(torch.cat(parts).all())
