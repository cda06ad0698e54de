"""Each decoder layer's experts of one kind as ONE tensor ``[E, ...]`` (expert ``e`` at index
``e``), named with the expert index starred (:func:`.hf_names.stacked_name`:
``model.layers.3.mlp.experts.*.gate_proj.weight``).

A Qwen3-30B-A3B sync carries ~37k per-expert packed tensors; the in-place SGLang sync sends
them as 48 x 3 x (packed tensors per weight) stacks instead. :func:`stack_experts` turns a
stream of per-expert tensors into stacks; :func:`stack_rows` makes one stack, as a view when
the experts already lie one after another in one storage (the split of a stacked quantization,
:func:`.pack_stream.pack_stream` with ``stack_experts``), else with one ``torch.stack``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from ..utils.hf_names import STACKED, layer_prefix, parse

__all__ = ["stack_experts", "stack_rows"]

Member = tuple[int, str, torch.Tensor]
"""``(expert index, per-expert name, tensor)``."""


def stack_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``; a view, without a copy, where ``tensors`` are contiguous
    equal-shaped neighbours in one storage (``tensors[i]`` starts where ``tensors[i-1]`` ends)."""
    first = tensors[0]
    n = first.numel()
    if n and first.is_contiguous():
        storage, start = first.untyped_storage().data_ptr(), first.storage_offset()
        if all(t.untyped_storage().data_ptr() == storage and t.is_contiguous()
               and t.shape == first.shape and t.dtype == first.dtype
               and t.storage_offset() == start + i * n for i, t in enumerate(tensors)):
            return first.as_strided((len(tensors), *first.shape), (n, *first.stride()), start)
    return torch.stack(list(tensors))


def stack_experts(stream: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` with each decoder layer's per-expert tensors stacked per kind.

    A kind stacks only when its tensors in the layer are exactly experts ``0..E-1``, once
    each, in ascending stream order, with one shape, dtype and device (:func:`stack_rows`,
    expert ``e`` at index ``e``); otherwise its tensors stay per expert, in stream order.
    Tensors that are not per-expert (stacked ones included) pass through at once; a layer's
    expert tensors are held until the layer ends, then emitted kind by kind in the order the
    kinds first appeared (if no kind stacks, exactly as they came). At most one layer's expert
    tensors are held."""
    held: list[tuple[str, torch.Tensor]] = []
    kinds: dict[str, list[Member]] = {}
    layer = None
    for name, t in stream:
        key = layer_prefix(name)
        if held and key != layer:
            yield from _flush(held, kinds)
            held, kinds = [], {}
        layer = key
        p = parse(name) if key is not None and isinstance(t, torch.Tensor) else None
        if p is None or p.expert is None or p.is_stacked:
            yield name, t
            continue
        held.append((name, t))
        kinds.setdefault(str(p._replace(expert=STACKED)), []).append((p.expert, name, t))
    if held:
        yield from _flush(held, kinds)


def _flush(held: list[tuple[str, torch.Tensor]], kinds: dict[str, list[Member]]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    stackable = {k: _stackable(members) for k, members in kinds.items()}
    if not any(stackable.values()):
        yield from held
        return
    held.clear()  # the caller's list: drop its references as the kinds go out
    for kind, members in kinds.items():
        if stackable[kind]:
            yield kind, stack_rows([t for _, _, t in members])
        else:
            yield from ((name, t) for _, name, t in members)
        members.clear()


def _stackable(members: list[Member]) -> bool:
    """Experts 0..E-1 once each in ascending order, one shape / dtype / device."""
    _, _, first = members[0]
    return all(e == i and t.shape == first.shape and t.dtype == first.dtype
               and t.device == first.device for i, (e, _, t) in enumerate(members))
