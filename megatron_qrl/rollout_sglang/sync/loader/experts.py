"""Expert tensors in the engine: unstacking, and loading straight into their ``FusedMoE``
parameters (the direct loads, opt-in per sync).

SGLang 0.5.17's Qwen3-MoE ``load_weights`` (``sglang/srt/models/qwen3_moe.py``) finds an expert
tensor's parameter by scanning ``FusedMoE.make_expert_params_mapping`` — 3 x num_experts
``(param_name, "experts.{e}.{proj}.", e, shard_id)`` entries, a substring test each — for every
tensor: ~190 tests per tensor on average, 37k tensors per 30B-A3B sync. The H200 phase log put
``load_weights`` at ~2 s of the engine's 2.3 s share. Here the same mapping is read off the
name once, giving the ``weight_loader(param, tensor, name, shard_id=..., expert_id=...)`` call
SGLang would make; the calls whose effect :mod:`.expert_batch` reproduces exactly are then
done many experts per copy (one stack + one ``index_copy_`` per parameter region), the others
are made one by one as SGLang makes them. Every other tensor still goes through
``model.load_weights``. Only for the model classes whose ``load_weights`` was read
(:data:`MODELS`); the sender opts in per sync (``SGLangOptions(direct_expert_loads=True)``).

Expert-stacked tensors (:mod:`..protocol`, ``SGLangOptions(stack_experts=True)``:
``...experts.*.gate_proj.weight`` of shape ``[E, ...]``) are loaded as the per-expert tensors
of their views ``t[e]``: the same ``ExpertLoad`` per expert, so batched and per-tensor loads
are exactly those of the per-expert stream. Stacked names are never returned for
``model.load_weights`` (which would skip them, having no parameter mapping for ``*``): what
cannot be loaded here is unstacked (:func:`unstack_all`: per-expert names and views ``t[e]``,
no copies).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_qrl.sync.protocol.inplace import expert_names, expert_views, parse_stacked
from megatron_qrl.utils.hf_names import parse

from .expert_batch import ExpertLoad, load_batched

__all__ = ["MODELS", "load_experts_directly", "unstack", "unstack_all"]

MODELS = frozenset({"Qwen3MoeForCausalLM"})
"""SGLang model classes whose expert mapping is ``FusedMoE.make_expert_params_mapping``'s."""

_SHARD = {"gate_proj": ("w13_", "w1"), "up_proj": ("w13_", "w3"), "down_proj": ("w2_", "w2")}
"""``make_expert_params_mapping(gate_proj, down_proj, up_proj)``: param prefix and shard id."""


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


def load_experts_directly(model: torch.nn.Module, modules: dict[str, torch.nn.Module],
                          weights: list[tuple[str, torch.Tensor]], counts: dict | None = None
                          ) -> list[tuple[str, torch.Tensor]]:
    """Load every expert tensor of ``weights`` (per expert or stacked) into its ``FusedMoE``
    parameter; return the rest (for ``model.load_weights``), stacked tensors unstacked into
    per-expert views. Tensors without a matching parameter are returned too. ``counts``
    (optional) gains ``experts`` (per-expert tensors loaded here) and ``experts_batched``
    (those written by batched copies; the rest went per tensor)."""
    if type(model).__name__ not in MODELS:
        return unstack_all(weights)
    rest, loads = [], []
    for name, t in weights:
        target = _target(modules, name)
        if target is None:
            rest.extend(unstack_all([(name, t)]))
            continue
        moe, param, loader, weight_name, shard, expert = target
        # a stacked tensor: expert e is its view t[e] (unstack's order, no copies)
        pairs = [(expert, t)] if expert is not None else enumerate(expert_views(name, t))
        for e, v in pairs:
            loads.append(ExpertLoad(len(loads), moe, param, loader, weight_name, shard, e, v,
                                    stack=t if expert is None else None))
    left = load_batched(loads)
    for ld in left:
        ld.loader(ld.param, ld.tensor, ld.weight_name, shard_id=ld.shard_id,
                  expert_id=ld.expert_id)
    if counts is not None:
        counts["experts"] = counts.get("experts", 0) + len(loads)
        counts["experts_batched"] = counts.get("experts_batched", 0) + len(loads) - len(left)
    return rest


def _target(modules: dict[str, torch.nn.Module], name: str):
    """``(moe, param, weight_loader, weight name, shard id, expert)`` an expert tensor loads
    through (``expert`` None for a stacked tensor: all of them), or None (not an expert
    tensor, or no such loader)."""
    p = parse(name)
    if p is None or p.expert is None:
        return None
    moe_name, proj, leaf = p.experts_module, p.proj, p.leaf
    expert = None if p.is_stacked else p.expert
    moe = modules.get(moe_name)
    if moe is None or not hasattr(moe, "num_local_experts"):
        return None
    prefix, shard = _SHARD[proj]
    param = moe._parameters.get(prefix + leaf)
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        return None
    return moe, param, loader, f"{moe_name}.{prefix}{leaf}", shard, expert
