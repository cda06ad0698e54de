"""Stream-pack HF tensors for the rollout engine, quantizing same-kind weights in batches.

The weight sync of Qwen3-30B-A3B packs ~18k HF tensors (48 layers x 128 experts x
gate/up/down, plus attention). One :meth:`~megatron_qrl.quant.spec_core.SpecCore.pack` per
tensor costs a dozen small kernels, so on a GPU the tensor count, not the bytes, sets the
time; the finiteness of every weight is checked once, at the end of the stream (one host
sync, :class:`~megatron_qrl.quant.finite_checks.FiniteChecks`), not with a device sync per
weight that would drain the GPU's queue. :func:`pack_stream` reads the stream in windows (one
decoder layer, at most ``window_bytes`` of input), quantizes each window's weights of one kind
(``model.layers.3.mlp.experts.*.gate_proj.weight``, same width/dtype/device) with ONE call of
:func:`~megatron_qrl.quant.stacked.quantize_stacks` where that is bit-identical
(:func:`~megatron_qrl.quant.stacked.can_stack`), and emits the packed tensors in exactly the
order, names, dtypes and bits of :func:`pack_one_at_a_time` (the reference, and the path of
``bf16``). Formats with a per-tensor scale (``nvfp4``) stack too: members of a fused group
(q/k/v, gate/up) are released together once complete, in the reference's order, a window
never splits a group, and each weight is quantized with its group's shared amax
(:func:`~megatron_qrl.quant.stacked.fused_amax`, no host sync). A stack is packed in one go
where the format's packing is row-local
(:meth:`~megatron_qrl.quant.spec_core.SpecCore.pack_stacked`).
Each emitted tensor owns its storage (pickling a view would send the whole stack), except with
``stack_experts``, whose expert stacks are made of the views.

A NaN / Inf weight raises :class:`~megatron_qrl.utils.finite.NonFiniteError` naming it (the
first such in stream order) when the consumer asks for the item after the last — before a transport
can mark its last bucket (:func:`megatron_qrl.sync.protocol.wire.buckets` marks it only once
the stream is exhausted), so the engine never gets the sync's weight version; the buckets
before, the bad weight's among them, may have been loaded (a partial update, as when any
step of a sync fails). An error of the stream itself is preceded by the non-finite weight
quantized before it, if any.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from ..utils.hf_names import layer_prefix
from ..utils.hf_names import stacked_name as tensor_kind
from .expert_stacks import stack_experts as stack_expert_stream
from .finite_checks import FiniteChecks
from .spec_core import SpecCore
from .stacked import (
    MAX_STACK_ELEMENTS,
    Amax,
    can_stack,
    fused_amax,
    quantize_stacks,
    split_stack,
)
from .weight import QuantizedWeight

DEFAULT_WINDOW_BYTES = 1 << 30
"""Input bytes buffered at most before a window is packed (besides the end of a layer)."""
CPU_STACK_ELEMENTS = 1 << 22
"""Largest stack of CPU weights (``stack_cpu``): fresh temporaries of MAX_STACK_ELEMENTS there
cost more in page faults than the tensor count saves (fp8 measured 4x slower)."""

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

Pairs = list[tuple[str, torch.Tensor]]
Pending = dict[str, dict[str, torch.Tensor]]
Quantized = Callable[[str], QuantizedWeight | None]
"""``hf_name -> `` its :meth:`SpecCore.quantize_weight` computed elsewhere (the trainer's
aligned-forward cache), or None: quantize it here."""

__all__ = ["layer_prefix", "pack_one_at_a_time", "pack_state_dict", "pack_stream",
           "tensor_kind", "writer_stream"]
"""``layer_prefix`` and ``tensor_kind`` (:func:`.hf_names.stacked_name`) come from
:mod:`.hf_names`; they are re-exported for the callers that import them from here."""


def pack_state_dict(spec: SpecCore, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                    window_bytes: int = DEFAULT_WINDOW_BYTES, stacked: bool = True,
                    stack_experts: bool = False, quantized: Quantized | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream-pack ``(hf_name, tensor)`` pairs (weight sync, export): :meth:`SpecCore.pack`
    per tensor, in stream order (``QuantSpec.pack_state_dict``).

    For formats with a per-tensor scale, members of a fused group (q/k/v, gate/up) are held
    back until the group is complete and packed with one shared amax. With ``stacked``
    (default) the weights of one kind in a window of the stream (one decoder layer, at most
    ``window_bytes`` of input) are quantized in one call where that is bit for bit the same
    (:func:`pack_stream`; GPU streams only, a CPU stream has no launches to save);
    ``stacked=False`` is the one-at-a-time reference (:func:`pack_one_at_a_time`). Both give
    the same names, order, dtypes and bits.

    ``stack_experts``: each decoder layer's packed experts of one kind as one tensor
    ``[E, ...]`` named ``...experts.*.<proj>.<leaf>`` (the in-place SGLang sync's wire form,
    :mod:`megatron_qrl.quant.expert_stacks`), from the stacked quantization's rows without
    per-expert copies; with ``stacked=False`` the reference's tensors are stacked.

    ``quantized``: where it gives a weight's quantization (the trainer's aligned-forward
    cache), that is packed and the weight is not quantized again; the stream then goes one
    tensor at a time (only the weights it lacks are quantized, there).

    A NaN / Inf weight raises :class:`~megatron_qrl.utils.finite.NonFiniteError` naming it
    at the end of the stream (module docstring): one host sync per stream, not one per
    weight.
    """
    if quantized is not None:
        packed = pack_one_at_a_time(spec, named_tensors, quantized)
        return stack_expert_stream(packed) if stack_experts else packed
    if not stacked:
        packed = pack_one_at_a_time(spec, named_tensors)
        return stack_expert_stream(packed) if stack_experts else packed
    return pack_stream(spec, named_tensors, window_bytes=window_bytes,
                       stack_experts=stack_experts)


def writer_stream(spec: SpecCore, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                  quantized: Quantized | None = None, stack_experts: bool = True
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream of an engine that quantizes the weights into its own memory itself
    (``RolloutEngine.quantizes_into``: the SGLang direct writer, ``QuantSpec.quantize_into``):
    the HF tensors as they are, except the weights whose quantization ``quantized`` gives
    (the trainer's aligned-forward cache), which come packed from it
    (:meth:`SpecCore.pack_quantized`: the cache's own tensors, not copied) and are not
    quantized again. With ``stack_experts`` each decoder layer's experts of one kind — weights
    and cached codes and scales alike — come as one ``[E, ...]`` stack
    (:func:`.expert_stacks.stack_experts`: a view where they lie one after another in one
    storage, as a stacked-experts trainer streams them)."""
    if spec.shares_tensor_scale:
        raise ValueError(f"{spec.name}: the members of a fused group share one tensor scale, "
                         "which a per-weight writer cannot compute; pack with pack_state_dict")
    given = quantized or (lambda _name: None)

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named_tensors:
            q = given(name) if spec.is_quantized(name) else None
            if q is None:
                yield name, t
            else:
                yield from spec.pack_quantized(name, q)

    return stack_expert_stream(items()) if stack_experts else items()


def pack_one_at_a_time(spec: SpecCore, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       quantized: Quantized | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The reference stream: :meth:`SpecCore.pack` per tensor, in stream order.

    For formats with a per-tensor scale, members of a fused group (q/k/v, gate/up) are held
    back until the group is complete and packed with one shared amax (the max of the
    members', :func:`~megatron_qrl.quant.stacked.fused_amax`: no host sync). ``quantized``:
    see :func:`pack_state_dict` (:meth:`SpecCore.pack_quantized` of what it gives). A NaN /
    Inf weight: :class:`~megatron_qrl.utils.finite.NonFiniteError` at the end of the stream.
    """
    finite = FiniteChecks()
    return _checked(spec, _one_at_a_time(spec, named_tensors, quantized, finite), finite)


def _checked(spec: SpecCore, packed: Iterator[tuple[str, torch.Tensor]], finite: FiniteChecks,
             order: dict[str, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``packed``, then the finiteness of every weight it quantized (one host sync): a
    non-finite weight raises :class:`~megatron_qrl.utils.finite.NonFiniteError` naming the
    first one in stream order (``order``: HF name -> position, where quantizing is not in
    stream order; else the first quantized). An error of ``packed`` itself comes after such
    a weight quantized before it (module docstring)."""
    try:
        yield from packed
    except Exception:
        finite.check(spec, order)
        raise
    finite.check(spec, order)


def _one_at_a_time(spec: SpecCore, named_tensors: Iterable[tuple[str, torch.Tensor]],
                   quantized: Quantized | None, finite: FiniteChecks
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`pack_one_at_a_time`'s stream; the weights' finiteness goes to ``finite``."""
    pending: Pending = {}
    group: Pairs = []
    given = quantized or (lambda _name: None)
    for name, w, size in _fused_order(spec, named_tensors, pending):
        if not size:
            q = given(name) if spec.is_quantized(name) else None
            yield from _pack_given(spec, name, w, q, finite)
            continue
        group.append((name, w))
        if len(group) == size:
            qs = [given(m) for m, _ in group]
            shared = _group_amax(spec, group) if any(q is None for q in qs) else None
            for (m, t), q in zip(group, qs):
                yield from _pack_given(spec, m, t, q, finite, shared)
            group = []
    _check_complete(spec, pending)


def _pack_given(spec: SpecCore, name: str, w: torch.Tensor, q: QuantizedWeight | None,
                finite: FiniteChecks, global_amax: torch.Tensor | float | None = None) -> Pairs:
    """:meth:`SpecCore.pack_quantized` of a given quantization, else :meth:`SpecCore.pack`."""
    if q is not None:
        return spec.pack_quantized(name, q)
    return spec.pack(name, w, global_amax=global_amax, finite=finite)


def _require_weights(spec: SpecCore, pairs: Pairs) -> None:
    """A clear error naming the first of ``pairs`` that is no ``[out, in]`` float weight
    (before an amax of it is taken)."""
    for name, w in pairs:
        if not (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in _FLOATS):
            spec.quantize_weight(w, name=name)


def _group_amax(spec: SpecCore, group: Pairs) -> torch.Tensor:
    """The shared amax of one complete fused group (an fp32 scalar on its device): the max
    of its members' amaxes, exactly :meth:`SpecCore.shared_amax`'s value, no host sync."""
    _require_weights(spec, group)
    return fused_amax([w for _, w in group], [len(group)])[0]


def _fused_order(spec: SpecCore, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 pending: Pending) -> Iterator[tuple[str, torch.Tensor, int]]:
    """``(name, tensor, group size)`` in the reference's emission order: a tensor outside any
    fused group at once (size 0); a fused group's members together, in member order, once its
    last member arrived. Groups still incomplete at the end are left in ``pending``."""
    for name, w in named_tensors:
        group = spec.fusion_group(name)
        if group is None:
            yield name, w, 0
            continue
        key, members = group
        got = pending.setdefault(key, {})
        got[name] = w
        if len(got) == len(members):
            del pending[key]
            for m in members:
                yield m, got[m], len(members)


def _check_complete(spec: SpecCore, pending: Pending) -> None:
    if pending:
        missing = {k: sorted(v) for k, v in pending.items()}
        raise ValueError(
            f"{spec.name}: fused groups incomplete at end of stream (q/k/v and gate/up "
            f"must be sent together so they share one scale): {missing}"
        )


def pack_stream(spec: SpecCore, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                window_bytes: int = DEFAULT_WINDOW_BYTES, stack_cpu: bool = False,
                stack_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`pack_one_at_a_time`'s stream, bit for bit, with weights quantized in batches.

    A window is packed when the decoder layer (``model.layers.N.``) changes, when it holds at
    least ``window_bytes`` of input, and at the end; never more is buffered. A stream whose
    first tensor is on the CPU goes one at a time unless ``stack_cpu`` (tests): the CPU has no
    kernel launches to save, and buffering and stacking measured slower there (page faults on
    fresh buffers instead of reused ones).

    ``stack_experts``: each decoder layer's packed experts of one kind come out as one stack
    (:func:`.expert_stacks.stack_experts`: ``...experts.*.gate_proj.weight`` ``[E, ...]``,
    after the layer's other tensors), made of the rows of the stacked quantization without
    per-expert copies (a view where one quantizer call covered the whole kind, else one
    ``torch.stack``); CPU streams are batched too. Same bits, expert ``e`` at row ``e``.
    """
    if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes <= 0:
        raise ValueError(f"pack_stream: window_bytes must be a positive int, got {window_bytes!r}")
    if not spec.quantizes_weights:
        packed = pack_one_at_a_time(spec, named_tensors)
    else:
        finite, order = FiniteChecks(), {}
        packed = _checked(spec, _by_device(spec, iter(named_tensors), window_bytes,
                                           stack_cpu or stack_experts, not stack_experts,
                                           finite, order), finite, order)
    return stack_expert_stream(packed) if stack_experts else packed


def _by_device(spec: SpecCore, pairs: Iterator[tuple[str, torch.Tensor]], window_bytes: int,
               stack_cpu: bool, own: bool, finite: FiniteChecks, order: dict[str, int]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    first = next(pairs, None)
    if first is None:
        return
    pairs = itertools.chain([first], pairs)
    on_cpu = not isinstance(first[1], torch.Tensor) or first[1].device.type == "cpu"
    if on_cpu and not stack_cpu:
        yield from _one_at_a_time(spec, pairs, None, finite)
    else:
        yield from _windows(spec, pairs, window_bytes, own, finite, order)


def _windows(spec: SpecCore, named_tensors: Iterable[tuple[str, torch.Tensor]],
             window_bytes: int, own: bool, finite: FiniteChecks, order: dict[str, int]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Cut the stream (in the reference's order) into windows, never inside a fused group;
    ``order``: each tensor's position in that order (a window quantizes kind by kind)."""
    pending: Pending = {}
    window: Pairs = []
    sizes: list[int] = []
    nbytes, layer, inside = 0, None, 0
    for name, w, size in _fused_order(spec, named_tensors, pending):
        key = layer_prefix(name)
        if window and key != layer and not inside:
            yield from _pack_window(spec, window, sizes, own, finite)
            window, sizes, nbytes = [], [], 0
        layer = key
        order[name] = len(order)
        window.append((name, w))
        sizes.append(size)
        inside = (inside + 1) % size if size else 0  # members of this group still to come
        nbytes += w.numel() * w.element_size() if isinstance(w, torch.Tensor) else 0
        if nbytes >= window_bytes and not inside:
            yield from _pack_window(spec, window, sizes, own, finite)
            window, sizes, nbytes = [], [], 0
    if window:
        yield from _pack_window(spec, window, sizes, own, finite)
    _check_complete(spec, pending)


def _pack_window(spec: SpecCore, window: Pairs, sizes: list[int], own: bool,
                 finite: FiniteChecks) -> Iterator[tuple[str, torch.Tensor]]:
    """Quantize the window's groups, then emit in stream order (dropping what was sent).
    ``own``: each packed tensor owns its storage (else splits of a stack stay views)."""
    packed = _quantize_window(spec, window, _window_amax(spec, window, sizes), own, finite)
    for i in range(len(window)):
        name, w = window[i]
        window[i] = ("", None)
        yield from packed.pop(i, None) or [(name, w)]


def _window_amax(spec: SpecCore, window: Pairs, sizes: list[int]) -> dict[int, torch.Tensor]:
    """The shared amax (fp32 scalar tensor) of every fused member of ``window``, by index;
    members of one group are consecutive there (:func:`_fused_order`)."""
    idx = [i for i, size in enumerate(sizes) if size]
    _require_weights(spec, [window[i] for i in idx])
    groups, j = [], 0
    while j < len(idx):
        groups.append(sizes[idx[j]])
        j += groups[-1]
    if not idx:
        return {}
    shared = fused_amax([window[i][1] for i in idx], groups)
    return dict(zip(idx, shared.unbind(0)))


def _quantize_window(spec: SpecCore, window: Pairs, amax: dict[int, torch.Tensor], own: bool,
                     finite: FiniteChecks) -> dict[int, Pairs]:
    """Packed tensors of every quantized weight of ``window``, by its index there."""
    groups: dict[tuple, list[int]] = {}
    for i, (name, w) in enumerate(window):
        if spec.is_quantized(name):
            key = ((tensor_kind(name), tuple(w.shape[1:]), w.dtype, w.device)
                   if isinstance(w, torch.Tensor) else (name, i))
            groups.setdefault(key, []).append(i)
    out: dict[int, Pairs] = {}
    for (kind, *_), idx in groups.items():
        names = [window[i][0] for i in idx]
        weights = [window[i][1] for i in idx]
        amaxes = [amax.get(i) for i in idx]
        stacked = can_stack(spec, weights)
        for i, pairs in zip(idx, _pack_group(spec, kind, names, weights, amaxes, stacked,
                                             finite)):
            out[i] = pairs
        if stacked and own:
            _own_storage([out[i] for i in idx])
    return out


def _pack_group(spec: SpecCore, kind: str, names: Sequence[str],
                weights: Sequence[torch.Tensor], amaxes: list[Amax], stacked: bool,
                finite: FiniteChecks) -> list[Pairs]:
    """The packed tensors of each weight of one kind; a stack's as views of its packing
    (:meth:`SpecCore.pack_stacked`) or of its quantization's split. Each weight's
    finiteness goes to ``finite`` under its own name (a stack's per row)."""
    if not stacked:
        return [spec.pack_quantized(n, spec.quantize_weight(w, global_amax=a, name=n,
                                                            finite=finite))
                for n, w, a in zip(names, weights, amaxes)]
    limit = CPU_STACK_ELEMENTS if weights[0].device.type == "cpu" else MAX_STACK_ELEMENTS
    out: list[Pairs] = []
    try:
        for q, rows in quantize_stacks(spec, weights, global_amax=amaxes, name=kind,
                                       max_elements=limit, finite=finite, names=names):
            part = names[len(out):len(out) + len(rows)]
            out += spec.pack_stacked(part, q, rows) or [
                spec.pack_quantized(n, w) for n, w in zip(part, split_stack(spec, q, rows))]
    except (ValueError, TypeError):
        # the stack is bad (a shape the format cannot take, say): name the exact tensor
        for n, w in zip(names, weights):
            spec.quantize_weight(w, name=n)
        raise
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """1-byte floats (float8) as uint8, so the fused copy needs no float8 kernel."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def _own_storage(packed: list[Pairs]) -> None:
    """Replace every tensor that is a view into a larger storage (a split of the stack) by a
    compact copy, in one fused copy per device (a format's small host tensors, such as
    w4a16's ``weight_shape``, sit beside the device's)."""
    where: dict[torch.device, list[tuple[int, int]]] = {}
    for j, pairs in enumerate(packed):
        for k, (_, t) in enumerate(pairs):
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                where.setdefault(t.device, []).append((j, k))
    for at in where.values():
        views = [packed[j][k][1] for j, k in at]
        copies = [torch.empty_like(v, memory_format=torch.contiguous_format) for v in views]
        torch._foreach_copy_([_as_bytes(c) for c in copies], [_as_bytes(v) for v in views])
        for (j, k), c in zip(at, copies):
            packed[j][k] = (packed[j][k][0], c)
