"""A LoRA model's tensors in HF / PEFT naming: frozen base, adapters, merged weights.

PEFT names (what ``peft`` saves and SGLang 0.5.17's ``load_lora_adapter_from_tensors`` /
``LoRAAdapter._process_weight`` read: the layer id is parsed from ``layers.<i>``, q/k/v and
gate/up are stacked by the engine)::

    base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight     [r, in]
    base_model.model.model.layers.<i>.self_attn.q_proj.lora_B.weight     [out, r]
    base_model.model.model.layers.<i>.mlp.experts.<e>.gate_proj.lora_A.weight

Every function here is collective over the model's TP / EP groups (all ranks iterate in
lockstep), as :func:`megatron_qrl.models.streaming.iter_hf_tensors` is; on a pipeline stage
(``groups.stage``) they address the stage's own layers under their global indices.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.models.lora import lora_linears
from megatron_qrl.models.mapping import rule_for
from megatron_qrl.models.stages import global_name
from megatron_qrl.models.streaming import (
    ShardGroups,
    _all_gather,
    _num_local_experts,
    _rank_size,
    iter_hf_tensors,
)

__all__ = ["PEFT_PREFIX", "adapter_tensors", "base_hf_tensors", "load_adapter_tensors",
           "merge_into", "peft_name"]

PEFT_PREFIX = "base_model.model."


def peft_name(hf_weight: str, factor: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight``, ``A`` -> its PEFT adapter name."""
    return f"{PEFT_PREFIX}{hf_weight.removesuffix('.weight')}.lora_{factor}.weight"


def _named_base(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(megatron name, local tensor)`` of every base tensor, frozen bases dequantized, in
    module order; adapters left out."""
    frozen = {name: lin for name, lin in lora_linears(model) if lin.qrl_frozen}
    for mod_name, module in model.named_modules():
        mod_name = mod_name.removeprefix("module.")
        prefix = f"{mod_name}." if mod_name else ""
        if mod_name in frozen:
            yield f"{prefix}weight", frozen[mod_name].qrl_base.dequantize()
        for pname, p in module.named_parameters(recurse=False):
            if ".lora_" in f"{prefix}{pname}" or mod_name.endswith(("lora_A", "lora_B")):
                continue
            yield f"{prefix}{pname}", p


def base_hf_tensors(model: torch.nn.Module, arch: ModelArch,
                    groups: ShardGroups | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of the base model (what the engine's base must hold)."""
    return iter_hf_tensors(model, arch, groups, named=_named_base(model))


def adapter_tensors(model: torch.nn.Module, arch: ModelArch,
                    groups: ShardGroups | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT name, full tensor)`` of every adapter, gathered over TP (and EP for experts)."""
    groups = groups or ShardGroups()
    ep_rank, ep_size = _rank_size(groups.ep)
    n_local = _num_local_experts(arch, groups)
    for name, lin in lora_linears(model):
        if not len(lin.lora_A):
            continue
        rule = rule_for(global_name(f"{name}.weight", groups.stage), arch, ep_rank, n_local)
        group = groups.etp if rule.expert else groups.tp
        full: list[tuple[int, str, torch.Tensor]] = []
        for i, proj in enumerate(lin.qrl_lora.projections):
            if proj not in lin.lora_A:
                continue
            a, b = lin.lora_A[proj].detach(), lin.lora_B[proj].detach()
            if lin._qrl_parallel_dim == 1:
                a = torch.cat(_all_gather(a, group), dim=1)
            else:
                b = torch.cat(_all_gather(b, group), dim=0)
            full += [(i, "A", a), (i, "B", b)]
        if not rule.expert or ep_size == 1:
            for i, f, t in full:
                yield peft_name(rule.hf_names[i], f), t.clone()
            continue
        per_rank = [_all_gather(t, groups.ep) for _, _, t in full]
        for r in range(ep_size):
            names = rule_for(global_name(f"{name}.weight", groups.stage), arch, r,
                             n_local).hf_names
            for (i, f, _), ts in zip(full, per_rank):
                yield peft_name(names[i], f), ts[r]


def load_adapter_tensors(model: torch.nn.Module, arch: ModelArch,
                         tensors: Mapping[str, torch.Tensor],
                         groups: ShardGroups | None = None) -> int:
    """Copy this rank's shard of every adapter from full PEFT tensors; returns the count.
    Raises KeyError naming a missing adapter, ValueError on a shape mismatch."""
    groups = groups or ShardGroups()
    ep_rank, _ = _rank_size(groups.ep)
    n_local = _num_local_experts(arch, groups)
    count = 0
    with torch.no_grad():
        for name, lin in lora_linears(model):
            if not len(lin.lora_A):
                continue
            rule = rule_for(global_name(f"{name}.weight", groups.stage), arch, ep_rank, n_local)
            rank, size = _rank_size(groups.etp if rule.expert else groups.tp)
            for i, proj in enumerate(lin.qrl_lora.projections):
                if proj not in lin.lora_A:
                    continue
                for f, param in (("A", lin.lora_A[proj]), ("B", lin.lora_B[proj])):
                    key = peft_name(rule.hf_names[i], f)
                    if key not in tensors:
                        raise KeyError(f"adapter tensor {key!r} is missing")
                    t = tensors[key]
                    dim = 1 if f == "A" else 0
                    if (lin._qrl_parallel_dim == 1) == (f == "A"):
                        t = t.chunk(size, dim=dim)[rank]
                    if tuple(t.shape) != tuple(param.shape):
                        raise ValueError(f"{key}: shard shape {tuple(t.shape)} != adapter "
                                         f"{tuple(param.shape)} (rank or model differ)")
                    param.copy_(t.to(param.dtype))
                    count += 1
    return count


def merge_into(hf_stream: Any, adapters: Mapping[str, torch.Tensor], scaling: float
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``W + scaling * B @ A`` for every HF weight with an adapter (LoRA eq. 3, merged);
    other tensors unchanged. The product is taken in fp32, cast to the weight's dtype."""
    for name, w in hf_stream:
        a = adapters.get(peft_name(name, "A"))
        if a is None:
            yield name, w
            continue
        b = adapters[peft_name(name, "B")]
        yield name, (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
