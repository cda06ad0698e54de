"""Expert-stacked wire tensors for the in-place sync (opt-in, with direct expert loads).

A Qwen3-30B-A3B sync is ~37k expert tensors (48 layers x 128 experts x gate/up/down x weight
and scale) and on the H200 every wire tensor costs the engine a fixed share (unpacking the
flat bucket, naming, loading). ``SGLangEngine(stack_experts=True)`` sends each decoder layer's
experts of one kind as ONE tensor instead:

* naming: the per-expert names ``<moe>.experts.<e>.<proj>.<leaf>`` (``proj`` gate_proj, up_proj
  or down_proj) of one layer and kind become ``<moe>.experts.*.<proj>.<leaf>`` — the expert
  index starred, as :func:`megatron_qrl.quant.pack_stream.tensor_kind` writes it, e.g.
  ``model.layers.3.mlp.experts.*.gate_proj.weight``;
* value: ``torch.stack`` of the experts' tensors, expert ``e`` at index ``e`` (shape
  ``[E, *per_expert_shape]``); :func:`unstack` gives back the per-expert names and views
  ``t[e]`` (no copies), bit for bit the tensors that were stacked.

A kind stacks only when its tensors in the layer are exactly experts ``0..E-1``, once each, in
ascending stream order, with one shape, dtype and device; otherwise its tensors go on the wire
per expert, as before (so several writes to one slot, e.g. redundant physical experts, keep the
stream's order). The receiver (:mod:`.inplace`, :mod:`.expert_loads`) loads a stacked tensor as
the per-expert tensors of its views; a stacked name must never reach SGLang's
``model.load_weights`` (it has no parameter mapping for ``*`` and would skip it silently), so
whatever is not loaded directly is unstacked first (:func:`unstack_all`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from ..quant.pack_stream import layer_prefix, tensor_kind

PER_EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.(?P<expert>\d+)\."
                        r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<leaf>[^.]+)$")
"""A per-expert tensor name; groups ``moe`` (the FusedMoE module), ``expert``, ``proj``,
``leaf``."""
_STACKED = re.compile(r"^(?P<moe>.+\.experts)\.\*\."
                      r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<leaf>[^.]+)$")


def parse_stacked(name: str) -> tuple[str, str, str] | None:
    """``(moe module, proj, leaf)`` of a stacked name
    (``model.layers.3.mlp.experts.*.up_proj.weight`` -> ``("model.layers.3.mlp.experts",
    "up_proj", "weight")``); None for any other name."""
    m = _STACKED.match(name)
    return (m["moe"], m["proj"], m["leaf"]) if m else None


def expert_name(stacked: str, expert: int) -> str:
    """The per-expert name of index ``expert`` of a stacked name."""
    return expert_names(stacked, expert + 1)[expert]


def expert_names(stacked: str, experts: int) -> list[str]:
    """The per-expert names of indices ``0 .. experts-1`` of a stacked name (parsed once)."""
    moe, proj, leaf = _parse_or_raise(stacked)
    return [f"{moe}.{e}.{proj}.{leaf}" for e in range(experts)]


def expert_views(name: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``t[0], t[1], ...``: the experts of the stacked tensor ``name`` (views, no names)."""
    if t.dim() == 0:
        raise ValueError(f"stacked expert tensor {name!r} is a scalar; expected [E, ...]")
    return t.unbind(0)


def unstack(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The per-expert ``(name, t[e])`` of a stacked tensor, experts in order (views)."""
    views = expert_views(name, t)
    return list(zip(expert_names(name, len(views)), views))


def unstack_all(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` with every stacked tensor replaced by its per-expert views, in place."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        if parse_stacked(name) is None:
            out.append((name, t))
        else:
            out.extend(unstack(name, t))
    return out


def _parse_or_raise(name: str) -> tuple[str, str, str]:
    parsed = parse_stacked(name)
    if parsed is None:
        raise ValueError(f"{name!r} is not a stacked expert name "
                         "('<prefix>.experts.*.<gate_proj|up_proj|down_proj>.<leaf>')")
    return parsed


def stack_experts(stream: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` with each decoder layer's per-expert tensors stacked per kind (module doc).

    Tensors that are not per-expert pass through at once, in order; a layer's expert tensors
    are held until the layer ends (the next tensor of another layer, or the end of the
    stream), then emitted kind by kind in the order the kinds first appeared — a stacked
    tensor, or the kind's per-expert tensors in stream order where it cannot stack (if no
    kind stacks, the layer's expert tensors are emitted exactly as they came). At most one
    layer's expert tensors are held."""
    held: list[tuple[str, torch.Tensor]] = []
    layer = None
    for name, t in stream:
        key = layer_prefix(name)
        if held and key != layer:
            yield from _flush(held)
            held = []
        layer = key
        if PER_EXPERT.match(name) and isinstance(t, torch.Tensor):
            held.append((name, t))
        else:
            yield name, t
    if held:
        yield from _flush(held)


def _flush(held: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    kinds: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    for name, t in held:
        kinds.setdefault(tensor_kind(name), []).append(
            (int(PER_EXPERT.match(name)["expert"]), name, t))
    stackable = {k: _stackable(members) for k, members in kinds.items()}
    if not any(stackable.values()):
        yield from held
        return
    held.clear()  # the caller's list: drop its references as the kinds go out
    for kind, members in kinds.items():
        if stackable[kind]:
            yield kind, torch.stack([t for _, _, t in members])
        else:
            yield from ((name, t) for _, name, t in members)
        members.clear()


def _stackable(members: list[tuple[int, str, torch.Tensor]]) -> bool:
    """Experts 0..E-1 once each in ascending order, one shape / dtype / device."""
    _, _, first = members[0]
    return all(e == i and t.shape == first.shape and t.dtype == first.dtype
               and t.device == first.device for i, (e, _, t) in enumerate(members))
