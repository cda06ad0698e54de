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
An engine joins each sender's group at the same offset. A sync is framed in segments
(:mod:`megatron_qrl.rollout.transports.sharded` / :func:`receive_sharded`): every sender's
non-expert segment (only sender 0's has tensors), then per decoder layer each sender's experts of that layer in
sender order, so a layer's experts reach the engine together and in ascending order (an
in-place reload sees the layer's experts module complete; expert stacking still applies).
The senders take turns, which costs nothing where the engines' receive bandwidth is the
limit (every engine rank receives the whole model either way).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..sync.protocol.wire import tensor_json, unflatten
from ..utils.hf_names import layer_prefix, parse
from .broadcast import broadcast_from_trainer

__all__ = ["WeightGroupPlan", "receive_sharded", "segment_key", "send_stream_end",
           "weight_group_plan"]

_STREAM_END = (0, 1)
"""The header that ends a sender's stream (a segment ends with ``(0, 0)``)."""


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


def segment_key(hf_name: str) -> str:
    """The segment a tensor travels in: ``""`` for non-expert tensors, else its decoder
    layer (``model.layers.3.``): a layer's experts form one segment per sender."""
    parts = parse(hf_name)
    return "" if parts is None or parts.expert is None else layer_prefix(hf_name) or ""


def send_stream_end(group: dist.ProcessGroup, device: torch.device | str) -> None:
    """The header that ends a sender's stream (after its last segment)."""
    broadcast_from_trainer(torch.tensor(_STREAM_END, dtype=torch.int64, device=device), group)


def _receive_segment(group: dist.ProcessGroup, device: torch.device | str
                     ) -> Generator[tuple[str, torch.Tensor], None, bool]:
    """One framed segment's tensors; returns True when the sender's stream ended instead."""
    while True:
        sizes = torch.empty(2, dtype=torch.int64, device=device)
        broadcast_from_trainer(sizes, group)
        n_meta, n_flat = (int(x) for x in sizes.tolist())
        if n_meta == 0:
            return (n_meta, n_flat) == _STREAM_END
        head = torch.empty(n_meta, dtype=torch.uint8, device=device)
        broadcast_from_trainer(head, group)
        flat = torch.empty(n_flat, dtype=torch.uint8, device=device)
        broadcast_from_trainer(flat, group)
        yield from unflatten(flat, tensor_json(head))


def receive_sharded(groups: Sequence[dist.ProcessGroup],
                    device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """One engine rank's side of a sharded sync (``send_segments`` on every sender's
    group): the non-expert segment of every sender, then layer by layer the experts of
    sender 0, 1, ...: a layer's experts arrive together and in ascending order (sender
    ``s`` holds the ``s``-th block of them), as one ``(name, tensor)`` stream."""
    live = list(groups)
    while live:
        for group in list(live):
            ended = yield from _receive_segment(group, device)
            if ended:
                live.remove(group)
