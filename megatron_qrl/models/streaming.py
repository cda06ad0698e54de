"""Stream HF tensors out of a TP/EP-sharded Megatron model, and load HF tensors into one.

:func:`iter_hf_tensors` gathers ONE parameter at a time over its tensor-parallel group
(expert tensor-parallel group for experts) and, for experts, over the expert-parallel
group, then yields ``(hf_name, full_tensor)`` pairs: every rank of the groups must iterate
it together (it issues collectives), and never holds more than one gathered parameter.
:func:`load_hf_weights` is the inverse: each rank slices its own shard out of full HF
tensors read lazily by name. Process groups are arguments; :func:`groups_from_parallel_state`
is the one place that reads megatron's ``parallel_state``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_qrl.models import layout
from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.models.mapping import ParamRule, per_expert_named, rule_for
from megatron_qrl.models.stages import PipelineStage, global_name, is_tied_output_copy


@dataclass(frozen=True)
class ShardGroups:
    """Process groups a model's parameters are sharded over; None means size 1."""

    tp: Any = None
    """Tensor-parallel group (attention, dense MLP, embeddings, output layer)."""
    ep: Any = None
    """Expert-parallel group (which experts a rank holds)."""
    etp: Any = None
    """Expert tensor-parallel group (how each expert is split); None when ETP == 1."""
    stage: PipelineStage | None = None
    """This rank's pipeline stage (``models.stages``); None: no pipeline. Its parameters
    carry local layer indices, mapped to the global ones here."""


def groups_from_parallel_state(num_layers: int | None = None) -> ShardGroups:
    """The groups megatron-core's ``parallel_state`` set up for this rank; ``num_layers``:
    the model's decoder layers (for the pipeline stage's layer offset)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    stage = None
    if pp > 1:
        if num_layers is None:
            raise ValueError("groups_from_parallel_state: pipeline parallel needs num_layers")
        stage = PipelineStage.of(ps.get_pipeline_model_parallel_rank(), pp, num_layers,
                                 ps.get_pipeline_model_parallel_group())
    return ShardGroups(tp=ps.get_tensor_model_parallel_group(),
                       ep=ps.get_expert_model_parallel_group(),
                       etp=ps.get_expert_tensor_parallel_group(), stage=stage)


def _rank_size(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    _, size = _rank_size(group)
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _unshard(rule: ParamRule, shards: list[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    """Full HF tensors (in ``rule.hf_names`` order) from all ranks' shards of one parameter;
    a single shard's (no tensor parallelism) are views of it where the layout allows (all but
    the query / key / value split out of the fused ``linear_qkv``)."""
    if rule.kind == "replicated":
        return [shards[0]]
    if rule.kind in ("column", "row"):
        return [shards[0] if len(shards) == 1 else torch.cat(shards, dim=int(rule.kind == "row"))]
    if rule.kind == "qkv":
        return list(layout.unshard_qkv(shards, arch.num_heads, arch.num_kv_heads, arch.head_dim))
    if len(shards) == 1:
        return list(shards[0].chunk(2, dim=0))
    return list(layout.unshard_gate_up(shards))


def _qkv_into(rule: ParamRule, shards: list[torch.Tensor], arch: ModelArch,
              buffers: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """:func:`_unshard` of a fused ``linear_qkv``: its query / key / value written into
    ``buffers`` (by HF name, made on first use) and returned from there, the same memory every
    time."""
    qkv = shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)
    out = []
    for name, part in zip(rule.hf_names, layout.qkv_parts(qkv, arch.num_heads,
                                                          arch.num_kv_heads, arch.head_dim)):
        shape = (part.shape[0] * part.shape[1], qkv.shape[-1])
        buf = buffers.get(name)
        if buf is None or (tuple(buf.shape), buf.dtype, buf.device) != (shape, part.dtype,
                                                                          part.device):
            buf = buffers[name] = torch.empty(shape, dtype=part.dtype, device=part.device)
        buf.view(part.shape).copy_(part)
        out.append(buf)
    return out


def _shard(rule: ParamRule, full: list[torch.Tensor], arch: ModelArch, rank: int,
           size: int) -> torch.Tensor:
    """This rank's shard of one parameter from its full HF tensors."""
    what = rule.hf_names[0]
    if rule.kind == "replicated":
        return full[0]
    if rule.kind == "column":
        return layout.shard(full[0], 0, rank, size, what)
    if rule.kind == "row":
        return layout.shard(full[0], 1, rank, size, what)
    if rule.kind == "qkv":
        return layout.shard_qkv(*full, arch.num_heads, arch.num_kv_heads, arch.head_dim, rank, size)
    return layout.shard_gate_up(full[0], full[1], rank, size, what)


def _is_adapter(name: str) -> bool:
    """LoRA adapter parameters have no HF tensor here (``models.lora_io`` streams them)."""
    return ".lora_A." in name or ".lora_B." in name


def _num_local_experts(arch: ModelArch, groups: ShardGroups) -> int:
    _, ep_size = _rank_size(groups.ep)
    return arch.num_experts // ep_size if arch.is_moe else 0


def iter_hf_tensors(model: torch.nn.Module, arch: ModelArch,
                    groups: ShardGroups | None = None,
                    named: Iterable[tuple[str, torch.Tensor]] | None = None,
                    gather_experts: bool = True, copy: bool = True,
                    buffers: dict[str, torch.Tensor] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every HF tensor of ``model``, one parameter at a time.

    Collective: all ranks of ``groups`` must consume the generator in lockstep. Tensors are
    detached copies in the parameter dtype; ``copy=False``: a tensor that is a view of the
    parameter's own memory (no tensor parallelism; everything but query / key / value) is
    yielded as that view, for a consumer that only reads it before the parameter changes
    next (the direct sync's writer), and with ``buffers`` (a dict the caller keeps) the
    query / key / value are written into persistent buffers kept there and yielded from them,
    the same memory every stream (one more copy of those weights, held by the caller: for a
    consumer that holds the tensors across streams, the SGLang engine's held parameters);
    experts come in (local index, EP rank) order.
    ``named``: the ``(megatron name, local tensor)`` pairs to stream instead of
    ``model.named_parameters()`` (a LoRA model's frozen bases, ``models.lora_io``).
    ``gather_experts`` False: no gather over the expert-parallel group; this rank yields
    only the experts it holds, under their global HF names (``megatron_qrl.rl.ep_send``).
    Stacked expert weights (``models.stacked_experts``) are streamed one expert at a time.
    """
    groups = groups or ShardGroups()
    ep_rank, ep_size = _rank_size(groups.ep)
    n_local = _num_local_experts(arch, groups)
    for name, param in per_expert_named(model.named_parameters() if named is None else named):
        if _is_adapter(name) or is_tied_output_copy(name, arch.tie_word_embeddings,
                                                    groups.stage):
            continue  # (the tied copy: the first stage streams the embedding)
        name = global_name(name, groups.stage)
        rule = rule_for(name, arch, ep_rank, n_local)
        shard_group = groups.etp if rule.expert else groups.tp
        shards = [param.detach()] if rule.kind == "replicated" else _all_gather(
            param.detach(), shard_group)
        into = not copy and buffers is not None and rule.kind == "qkv"
        full = _qkv_into(rule, shards, arch, buffers) if into else _unshard(rule, shards, arch)
        if not rule.expert or ep_size == 1 or not gather_experts:
            yield from zip(rule.hf_names, (t.clone() if copy else t for t in full))
            continue
        per_rank = [_all_gather(t, groups.ep) for t in full]
        for r in range(ep_size):
            names = rule_for(name, arch, r, n_local).hf_names
            yield from zip(names, (tensors[r] for tensors in per_rank))


def load_hf_weights(model: torch.nn.Module, arch: ModelArch, get_tensor: Callable[[str], torch.Tensor],
                    groups: ShardGroups | None = None,
                    progress: Callable[[str], None] | None = None) -> set[str]:
    """Copy this rank's shard of every parameter from full HF tensors; return the names used.

    ``get_tensor(hf_name)`` returns a full HF tensor (e.g. a lazy safetensors read). Raises
    ValueError naming the parameter when a shard's shape does not match the model's.
    """
    groups = groups or ShardGroups()
    tp_rank, tp_size = _rank_size(groups.tp)
    etp_rank, etp_size = _rank_size(groups.etp)
    ep_rank, _ = _rank_size(groups.ep)
    n_local = _num_local_experts(arch, groups)
    used: set[str] = set()
    with torch.no_grad():
        for name, param in per_expert_named(model.named_parameters()):
            if _is_adapter(name):
                continue
            if is_tied_output_copy(name, arch.tie_word_embeddings, groups.stage):
                name = "embedding.word_embeddings.weight"  # the last stage's tied copy
            rule = rule_for(global_name(name, groups.stage), arch, ep_rank, n_local)
            full = [get_tensor(n) for n in rule.hf_names]
            rank, size = (etp_rank, etp_size) if rule.expert else (tp_rank, tp_size)
            value = _shard(rule, full, arch, rank, size)
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: shard of {list(rule.hf_names)} has shape {tuple(value.shape)}, the "
                    f"model expects {tuple(param.shape)}; the checkpoint does not match config.json")
            param.copy_(value.to(param.dtype))
            used.update(rule.hf_names)
            if progress is not None:
                progress(name)
    return used
