"""Count the torch ops a piece of training code issues, and the ones that would stall a GPU.

A GPU trainer is fast while the host queues kernels ahead of the device. Two things stop that:
an op that reads a device tensor on the host (the host waits until the device has caught up:
``.item()``, ``bool(t)`` / ``if t:``, ``.tolist()``, ``.cpu()``, ``nonzero``,
``masked_select``, boolean-mask indexing, ``unique``, ``bincount``, ``repeat_interleave``
without ``output_size``, ``torch.equal``), and a large count of small ops (each launch costs
host time). :class:`OpCensus` counts both while ordinary code runs on the CPU, so the counts
can be checked by tests and printed by ``bench/op_census.py``.

On the CPU every tensor is a host tensor, so the census tracks which tensors WOULD live on the
device: those marked with :meth:`OpCensus.mark_device` (the model's parameters and gradient
buffers, the optimizer's state, a micro batch once the trainer moves it) and every tensor an
op computes from a marked one. A host read of a marked tensor is a host sync; a host tensor
moved with ``.to(device)`` is counted as a host-to-device copy (pageable memory: the copy may
wait for the stream). Factory ops (``torch.arange(n, device=...)``) are not marked: on the CPU
their device argument cannot be told from ``"cpu"``; reads of such tensors are missed.

Each sync is recorded with the innermost Python frame outside torch (``file:line``) and the
first frame in this package, so a sync inside megatron-core is attributed to upstream with the
line of ours that called it.

Passes: given ``kinds`` (a name -> predicate on a tensor, e.g. "an expert weight stack"), every
aten op that reads or writes such a tensor counts as one pass over that kind — views, reshapes
and other metadata ops excepted — so a variant's extra passes over the expert weights or the
permuted tokens can be counted on the CPU (a GPU's fused kernel is one pass where the CPU's
torch reference runs several).
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["OpCensus", "SyncOp"]

_MARK = "_qrl_on_device"
_ALWAYS_SYNC = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique",
                "_unique2", "unique_dim", "unique_consecutive", "bincount", "equal"}
"""aten ops (overload packet names) that read a device input on the host."""
_HOST_METHODS = {"tolist", "numpy", "cpu"}
"""Tensor methods that copy a device tensor to the host (no aten op on a CPU tensor)."""
_NO_PASS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "slice", "select",
            "expand", "as_strided", "detach", "unsqueeze", "squeeze", "split", "split_with_sizes",
            "unbind", "alias", "view_as", "empty", "empty_like", "empty_strided", "narrow",
            "chunk", "lift_fresh", "_to_copy_noop", "set_", "resize_", "diagonal", "unflatten",
            "flatten", "movedim", "numpy_T", "_reshape_alias"}
"""aten ops that move no element (metadata, allocation): never a pass."""
_PACKAGE = str(Path(__file__).resolve().parents[1])
_TORCH = str(Path(torch.__file__).resolve().parent)
_SKIP = (_TORCH, __file__, "<frozen ", "/contextlib.py", "/functools.py",
         str(Path(_PACKAGE) / "compat" / "cpu.py"))
"""Frames never reported: torch, this module, the CPU shim's torch-function mode."""


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _on_device(obj: Any) -> bool:
    return any(getattr(t, _MARK, False) for t in _tensors(obj))


def _mark(obj: Any) -> None:
    for t in _tensors(obj):
        try:
            setattr(t, _MARK, True)
        except (AttributeError, RuntimeError):  # a tensor subclass without a __dict__
            pass


def _cuda(device: Any) -> bool:
    """``device`` names a CUDA device (megatron-core's placements, before a CPU shim
    rewrites them)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return (isinstance(device, str) and device.startswith("cuda")) \
        or (isinstance(device, int) and not isinstance(device, bool))


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def sync_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why aten op ``func`` reads its (device) inputs on the host, or None."""
    name = func.overloadpacket.__name__
    if name in _ALWAYS_SYNC:
        return name
    if name == "repeat_interleave" and func._overloadname == "Tensor" \
            and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and _has_bool_index(args):
        return f"{name} with a boolean mask"
    return None


@dataclass
class SyncOp:
    """One host sync: what it was, where it was called, whose code it is."""

    what: str
    frame: str
    """Innermost ``file:line`` outside torch."""
    ours: str | None
    """Innermost ``file:line`` in this package (None: none on the stack)."""
    phase: str

    @property
    def owner(self) -> str:
        """``ours`` when the innermost frame is in this package, else ``upstream``."""
        return "ours" if self.ours is not None and self.ours == self.frame else "upstream"


def _frames() -> tuple[str, str | None]:
    inner = ours = None
    for fs in reversed(traceback.extract_stack()):
        if any(s in fs.filename for s in _SKIP):
            continue
        where = f"{_short(fs.filename)}:{fs.lineno}"
        inner = inner or where
        if fs.filename.startswith(_PACKAGE):
            ours = where
            break
    return inner or "?", ours


def _short(path: str) -> str:
    for root in ("site-packages/", str(Path(_PACKAGE).parent) + "/"):
        if root in path:
            return path.split(root, 1)[1]
    return path


@dataclass
class _Counts:
    ops: Counter = field(default_factory=Counter)
    where: Counter | None = None
    """``file:line`` -> ops issued there (innermost frame outside torch); with ``frames``."""
    syncs: list[SyncOp] = field(default_factory=list)
    h2d: list[SyncOp] = field(default_factory=list)
    passes: Counter = field(default_factory=Counter)
    """kind -> ops that read or wrote a tensor of that kind (:class:`OpCensus` ``kinds``)."""


class _Dispatch(TorchDispatchMode):
    def __init__(self, census: OpCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = _on_device((args, kwargs))
        c = self.census
        c.current.ops[str(func.overloadpacket.__name__)] += 1
        if c.current.where is not None:
            c.current.where[_frames()[0]] += 1
        if dev:
            reason = sync_reason(func, args, kwargs)
            if reason is not None:
                c.record(reason)
        out = func(*args, **kwargs)
        if c.kinds and func.overloadpacket.__name__ not in _NO_PASS:
            c.count_passes((args, kwargs, out))
        if dev and func.overloadpacket.__name__ != "_local_scalar_dense":
            _mark(out)
        return out


class _Function(TorchFunctionMode):
    def __init__(self, census: OpCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        dev = _on_device((args, kwargs))
        if dev and name in _HOST_METHODS:
            self.census.record(f".{name}()")
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):  # .cpu() of a CPU tensor is the tensor itself
                out = out.detach()
                setattr(out, _MARK, False)
            return out
        out = func(*args, **kwargs)
        if dev or _cuda(kwargs.get("device")):
            _mark(out)
        elif name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor) \
                and (len(args) > 1 or "device" in kwargs) \
                and not (len(args) > 1 and isinstance(args[1], torch.dtype)):
            self.census.record(f".{name}(device) of a host tensor", h2d=True)
            _mark(out)
        return out


class OpCensus:
    """Count ops and host syncs per phase (module docstring)::

        census = OpCensus()
        census.mark_device(model.parameters())
        with census.phase("fwd+bwd"):
            loss = model(x).sum(); loss.backward()
        census.phases["fwd+bwd"].syncs
    """

    def __init__(self, frames: bool = False, kinds: dict[str, Any] | None = None) -> None:
        self.frames = frames
        """Also count each op's frame (``phases[name].where``; slow: a stack walk per op)."""
        self.kinds: dict[str, Any] = dict(kinds or {})
        """name -> ``predicate(tensor) -> bool``: ops touching such a tensor count as passes
        over it (``phases[name].passes``; module docstring)."""
        self.phases: dict[str, _Counts] = {}
        self.current = _Counts()
        self._name = ""

    @staticmethod
    def mark_device(tensors: Any) -> None:
        """Treat ``tensors`` (any nesting of lists / dicts / tuples) as device tensors."""
        _mark(list(tensors) if not isinstance(tensors, (dict, list, tuple, torch.Tensor))
              else tensors)

    def count_passes(self, operands: Any) -> None:
        """One pass per kind of which an op's ``operands`` (inputs and outputs) hold a tensor."""
        ts = _tensors(operands)
        for kind, pred in self.kinds.items():
            if any(pred(t) for t in ts):
                self.current.passes[kind] += 1

    def record(self, what: str, h2d: bool = False) -> None:
        inner, ours = _frames()
        op = SyncOp(what, inner, ours, self._name)
        (self.current.h2d if h2d else self.current.syncs).append(op)

    def phase(self, name: str) -> _PhaseContext:
        """Count what runs inside the block under ``name`` (counts add up over blocks)."""
        return _PhaseContext(self, name)

    def total_ops(self, name: str) -> int:
        return sum(self.phases[name].ops.values())

    def syncs(self, name: str, owner: str | None = None) -> list[SyncOp]:
        """The phase's host syncs (``owner``: only ``ours`` / ``upstream``)."""
        return [s for s in self.phases[name].syncs if owner is None or s.owner == owner]


class _PhaseContext:
    def __init__(self, census: OpCensus, name: str) -> None:
        self.census, self.name = census, name
        self._modes: tuple = ()

    def __enter__(self) -> OpCensus:
        c = self.census
        c.current = c.phases.setdefault(self.name, _Counts(where=Counter() if c.frames else None))
        c._name = self.name
        self._modes = (_Function(c), _Dispatch(c))
        for m in self._modes:
            m.__enter__()
        return c

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self.census.current = _Counts()
