"""Who is in the fleet's weight-sync broadcast groups: the senders and every engine TP rank.

Pure, plus the two ends of a sharded stream. A fleet of engines with engine TP ``tp_i``
receives weights from ``senders`` trainer ranks: rank 0 alone without trainer expert
parallelism, or (trainer EP > 1) the EP ranks of rank 0's expert group, each sending the
experts it holds (:mod:`megatron_qrl.rl.ep_send`). Every engine TP rank (an SGLang scheduler
of the engine, or the engine actor itself for a one-process engine) receives every bucket,
as SGLang's ``update_weights_from_distributed`` does (each TP rank slices what it holds).

The broadcast groups together span ``senders + sum(tp_i)`` ranks (:attr:`WeightGroupPlan.
total_ranks`). There is ONE group per sender, each ``1 + sum(tp_i)`` ranks with the sender
as rank 0 and engine ``i``'s TP ranks at ``offset(i) .. offset(i) + tp_i - 1``
(``rank_offset`` of SGLang's ``init_weights_update_group``), not one group holding every
sender: a broadcast reaches every member, so sender 0 in a shared group would receive (and
materialise) the other senders' experts, and SGLang's receivers broadcast from group rank 0.
An engine joins each sender's group at the same offset; a sync is the senders' streams one
after the other (:func:`receive_sharded`), which costs nothing where the engines' receive
bandwidth is the limit (every engine rank receives the whole model either way).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .broadcast import receive_stream

__all__ = ["WeightGroupPlan", "receive_sharded", "weight_group_plan"]


@dataclass(frozen=True)
class WeightGroupPlan:
    """The ranks of the fleet's weight groups (module docstring)."""

    senders: int
    engine_ranks: tuple[int, ...]
    """Per engine: its ranks in each group (its TP size; 1 for a one-process engine)."""

    @property
    def group_world_size(self) -> int:
        """Ranks of ONE sender's group: the sender + every engine TP rank."""
        return 1 + sum(self.engine_ranks)

    @property
    def total_ranks(self) -> int:
        """Distinct ranks over all groups: the senders + every engine TP rank."""
        return self.senders + sum(self.engine_ranks)

    def offset(self, engine: int) -> int:
        """Group rank of engine ``engine``'s first TP rank (in every sender's group)."""
        return 1 + sum(self.engine_ranks[:engine])

    def ranks(self, engine: int) -> range:
        """Engine ``engine``'s ranks in every sender's group."""
        return range(self.offset(engine), self.offset(engine) + self.engine_ranks[engine])

    def group_name(self, base: str, sender: int) -> str:
        """The name of sender ``sender``'s group (unique per sync group set ``base``)."""
        return base if self.senders == 1 else f"{base}-s{sender}"


def weight_group_plan(engine_ranks: Sequence[int], senders: int = 1) -> WeightGroupPlan:
    """The plan for engines of ``engine_ranks`` TP ranks fed by ``senders`` trainer ranks."""
    ranks = tuple(engine_ranks)
    if not ranks or any(not isinstance(r, int) or r < 1 for r in ranks):
        raise ValueError(f"weight groups: every engine has >= 1 TP rank, got {list(ranks)}")
    if not isinstance(senders, int) or senders < 1:
        raise ValueError(f"weight groups: senders must be >= 1 (trainer EP ranks), got {senders}")
    return WeightGroupPlan(senders, ranks)


def receive_sharded(groups: Sequence[torch.distributed.ProcessGroup],
                    device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """One engine rank's side of a sharded sync: sender 0's framed stream
    (:func:`~megatron_qrl.rollout.broadcast.send_stream`), then sender 1's, ... as one
    ``(name, tensor)`` stream."""
    for group in groups:
        yield from receive_stream(group, device)
