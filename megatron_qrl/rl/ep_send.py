"""Expert-parallel trainer ranks send their own experts: no gather of all experts onto rank 0.

With trainer EP > 1 the plain sync (:func:`~megatron_qrl.models.streaming.iter_hf_tensors`)
all-gathers every expert over the EP group and rank 0 sends the whole model: rank 0
materialises all experts (30B of Qwen3-30B-A3B) once per sync. Here the senders are the
ranks of rank 0's expert-parallel group with expert-TP rank 0 (one per EP rank,
:func:`ep_sender`); sender ``s`` broadcasts the experts it holds, under their global HF
names, into its own weight group (:mod:`megatron_qrl.rollout.weight_groups`: the sender +
every engine TP rank), and rank 0 (sender 0) sends the non-expert tensors as well. The
engines receive sender 0's stream, then sender 1's, ... (:func:`~megatron_qrl.rollout.
weight_groups.receive_sharded`).

Order, so that a sender blocked in its broadcast never holds up a collective another sender
needs: every rank streams ALL non-expert parameters first (their tensor-parallel gathers
run while no rank broadcasts experts), then its experts (gathers only within the
expert-TP group, whose ranks share one EP rank). Sender ``s`` blocks only in the expert
phase, waiting for the engines to finish senders ``0..s-1``, whose remaining collectives
involve other EP ranks only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.models.mapping import per_expert_named, rule_for
from megatron_qrl.models.streaming import ShardGroups, iter_hf_tensors
from megatron_qrl.quant.hf_names import parse

__all__ = ["EPSender", "ep_sender", "sharded_hf_stream"]


@dataclass(frozen=True)
class EPSender:
    """This rank's part in a sharded sync."""

    index: int | None
    """Sender index (this rank's EP rank) and so its weight group; None: sends nothing."""
    senders: int
    """Sending ranks (the trainer's EP size)."""
    main: bool
    """Global rank 0: sends the non-expert tensors too."""


def _rank_size(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def ep_sender(groups: ShardGroups) -> EPSender:
    """Whether (and as which sender) this rank sends: the ranks of global rank 0's EP group
    with expert-TP rank 0 (module docstring)."""
    ep_rank, ep_size = _rank_size(groups.ep)
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        return EPSender(0, ep_size, True)
    in_rank0_group = groups.ep is not None and 0 in dist.get_process_group_ranks(groups.ep)
    sends = in_rank0_group and _rank_size(groups.etp)[0] == 0
    return EPSender(ep_rank if sends else None, ep_size, False)


def _dense_first(model: torch.nn.Module, arch: ModelArch,
                 groups: ShardGroups) -> list[tuple[str, torch.Tensor]]:
    """``model``'s parameters, non-expert ones first, then the experts (module docstring)."""
    ep_rank, ep_size = _rank_size(groups.ep)
    n_local = arch.num_experts // ep_size if arch.is_moe else 0
    named = list(per_expert_named(model.named_parameters()))
    expert = {n for n, _ in named
              if ".lora_" not in n and rule_for(n, arch, ep_rank, n_local).expert}
    return [p for p in named if p[0] not in expert] + [p for p in named if p[0] in expert]


def sharded_hf_stream(model: torch.nn.Module, arch: ModelArch, groups: ShardGroups,
                      sender: EPSender | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(hf_name, tensor)`` pairs this rank sends: rank 0 the non-expert tensors and its
    experts, another sender its experts only, other ranks nothing. Collective: every rank
    of ``groups`` consumes it to the end (the tensor-parallel gathers), none gathers over EP."""
    sender = sender if sender is not None else ep_sender(groups)
    named = _dense_first(model, arch, groups)
    for name, t in iter_hf_tensors(model, arch, groups, named=named, gather_experts=False):
        if sender.index is not None and (sender.main or _is_expert_name(name)):
            yield name, t


def _is_expert_name(hf_name: str) -> bool:
    parts = parse(hf_name)
    return parts is not None and parts.expert is not None
