"""MoE routing replay: the trainer routes each token to the experts the rollout engine chose.

A tiny router-logit difference between the quantized rollout and the BF16 trainer flips a
top-k choice, and the token then goes through other experts: the largest source of
train/rollout mismatch in MoE RL (docs/ALGORITHMS.md section 6; "rollout routing replay", R3,
Ma et al. 2025). With replay the trainer uses the rollout's expert ids; the gates
are still the trainer's own: with ``norm_topk_prob`` (``moe_router_pre_softmax=False``)
``g_i = softmax(l_{e_1..e_k})_i`` over the replayed experts' logits, otherwise
``g_i = softmax(l)_{e_i}`` of the full softmax, so gradients reach the router.

:class:`RoutingReplay` is one context object per model, handed to every router through the
layer spec (:func:`replay_spec_hook`); it holds the replay tensor ``[tokens, num_moe_layers,
top_k]`` of GLOBAL expert ids (so it is independent of expert parallelism) in megatron-core's
token order (sequence-major: token ``s * batch + b``; see :func:`tokens_from_batch`) and records
the trainer's own top-k per layer for :func:`routing_agreement`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter

MODES = ("off", "recompute", "all")
PHASES = ("recompute", "update")


def tokens_from_batch(expert_ids: torch.Tensor) -> torch.Tensor:
    """Rollout layout ``[batch, seq, layers, top_k]`` -> megatron order ``[seq*batch, layers, top_k]``."""
    if expert_ids.dim() != 4:
        raise ValueError(f"expert_ids must be [batch, seq, layers, top_k], got {tuple(expert_ids.shape)}")
    b, s, n_layers, k = expert_ids.shape
    return expert_ids.transpose(0, 1).reshape(s * b, n_layers, k)


class RoutingReplay:
    """Replay tensor, mode and recorded routing shared by the routers of one model."""

    def __init__(self, mode: str = "off", num_experts: int = 0, top_k: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"--qrl-routing-replay must be one of {MODES}, got {mode!r}")
        self.mode = mode
        """``off`` | ``recompute`` (pi_prox recompute only) | ``all`` (the update too)."""
        self.num_experts = num_experts
        self.top_k = top_k
        self.expert_ids: torch.Tensor | None = None
        """``[tokens, num_moe_layers, top_k]`` global expert ids of the current batch."""
        self.phase: str | None = None
        self.recorded: dict[int, torch.Tensor] = {}
        """MoE layer index -> the trainer's own top-k ids ``[local tokens, top_k]`` (last forward)."""
        self.record: bool = True
        """Record the trainer's own top-k in :attr:`recorded`. Off (:meth:`use`'s ``record``),
        a replaying router computes no top-k of its own and a fused router no top-k of its
        routing map: nothing reads them then (the trainer measures the routing agreement only
        in the forwards it asks for)."""

    @property
    def active(self) -> bool:
        """True if the routers must use the replayed experts in this forward."""
        return self.expert_ids is not None and self._replays(self.phase)

    def _replays(self, phase: str | None) -> bool:
        """The routers replay the rollout's experts in a forward of ``phase``: every forward
        under ``all``, the log-prob recompute under ``recompute``, none under ``off``."""
        return self.mode == "all" or (self.mode != "off" and phase == "recompute")

    def reads_ids(self, phase: str, record: bool) -> bool:
        """Whether a forward of ``phase`` reads the rollout's expert ids: the routers replay
        them (``all``; ``recompute`` in the recompute) or the forward measures the routing
        agreement against them (``record``). Else the trainer leaves them out of the micro
        batches (no host check, no copy to the device, no reordering)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        return record or self._replays(phase)

    @contextmanager
    def use(self, expert_ids: torch.Tensor | None, phase: str,
            record: bool = True) -> Iterator[None]:
        """Run a forward (and its backward) of ``phase`` with the rollout's ``expert_ids``;
        ``record``: keep the trainer's own top-k per layer (:attr:`record`)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if expert_ids is not None:
            self._check(expert_ids)
        saved = (self.expert_ids, self.phase, self.record)
        self.expert_ids, self.phase, self.record = expert_ids, phase, record
        self.recorded = {}
        try:
            yield
        finally:
            self.expert_ids, self.phase, self.record = saved

    def set_micro_batch(self, expert_ids: torch.Tensor | None) -> None:
        """Replace the replay ids inside a ``use(...)`` block (call from ``forward_step_func``
        before each micro-batch's forward; the schedule runs them one after another).

        With activation recompute of MoE layers the router runs again in the backward and
        reads the ids current THEN; with pipeline parallelism (interleaved micro-batches)
        that is another micro-batch's, so keep MoE layers out of recompute when replaying.
        Checks shape and dtype only: the trainer checked the values on the host before the
        micro batches moved (:meth:`check_values`), so the same code runs on every device
        without reading ``expert_ids`` back.
        """
        if expert_ids is not None:  # values: checked by the trainer on the host
            self._check(expert_ids, values=False)
        self.expert_ids = expert_ids
        self.recorded = {}

    def _check(self, ids: torch.Tensor, values: bool = True) -> None:
        """Shape and dtype; the values too (``values``) where that costs no device sync (host
        ids). The trainer checks a batch's ids on the host before they move to the GPU
        (:meth:`check_values`, ``PolicyTrainer``), so a micro batch's forward never waits."""
        if ids.dim() != 3 or (self.top_k and ids.shape[2] != self.top_k):
            raise ValueError(f"routing replay: expert ids must be [tokens, num_moe_layers, top_k="
                             f"{self.top_k}], got {tuple(ids.shape)}")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise TypeError(f"routing replay: expert ids must be integers, got {ids.dtype}")
        if values and ids.device.type == "cpu":
            self.check_values(ids)

    def check_values(self, ids: torch.Tensor) -> None:
        """Raise if an expert id is outside ``[0, num_experts)`` (reads ``ids``: on a device
        tensor this waits for the device)."""
        if self.num_experts and bool(((ids < 0) | (ids >= self.num_experts)).any()):
            raise ValueError(f"routing replay: expert ids outside [0, {self.num_experts})")

    def layer_ids(self, moe_layer: int, num_tokens: int, shard: tuple[int, int]) -> torch.Tensor:
        """Replayed ids ``[num_tokens, top_k]`` of ``moe_layer`` for this rank's token shard."""
        ids = self.expert_ids
        if moe_layer >= ids.shape[1]:
            raise ValueError(f"routing replay: tensor has {ids.shape[1]} MoE layers, the model "
                             f"asks for layer index {moe_layer}")
        rank, size = shard
        if ids.shape[0] != num_tokens * size:
            raise ValueError(f"routing replay: tensor has {ids.shape[0]} tokens, this forward has "
                             f"{num_tokens * size} (sequence x batch); pass ids of the same batch")
        return ids[rank * num_tokens:(rank + 1) * num_tokens, moe_layer].long()


class _LayerReplay:
    """megatron-core's ``router_replay`` duck type for one router (see ``moe_utils``)."""

    def __init__(self, router: ReplayTopKRouter) -> None:
        self.router = router

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Any, group_topk: Any,
                        default_compute_topk: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.router
        replay = r.replay
        if replay.active and not replay.record:  # the rollout's experts, no top-k of our own
            idx = replay.layer_ids(r.moe_layer_index, scores.shape[0], r.token_shard())
            return scores.gather(1, idx.to(scores.device)), idx.to(scores.device)
        own_vals, own_idx = default_compute_topk(scores, topk, num_groups=num_groups,
                                                 group_topk=group_topk)
        if replay.record:
            replay.recorded[r.moe_layer_index] = own_idx.detach()
        if not replay.active:
            return own_vals, own_idx
        idx = replay.layer_ids(r.moe_layer_index, scores.shape[0], r.token_shard()).to(scores.device)
        return scores.gather(1, idx), idx


def check_replay_config(config: Any) -> None:
    """Raise a clear error for router settings routing replay cannot honour."""
    if config.moe_expert_capacity_factor is not None:
        raise ValueError("routing replay needs token dropping off: unset "
                         "moe_expert_capacity_factor (--moe-expert-capacity-factor)")
    if config.moe_router_score_function != "softmax" or config.moe_router_num_groups:
        raise ValueError("routing replay supports softmax top-k routing without groups "
                         "(Qwen3-MoE); this config uses another router")


class ReplayTopKRouter(TopKRouter):
    """megatron-core ``TopKRouter`` that can take its top-k experts from the rollout.

    With ``moe_router_fusion`` (TE's fused top-k + aux-loss scores) a forward that replays runs
    the unfused top-k (the fused kernel has no replay hook); any other forward runs fused and
    records its experts from the routing map. The router holds its own copy of the config for
    that switch, so no other module sees it change."""

    def __init__(self, config: Any, pg_collection: Any = None, *, replay: RoutingReplay) -> None:
        check_replay_config(config)
        super().__init__(config=config, pg_collection=pg_collection)
        self.replay = replay
        self.router_replay = _LayerReplay(self)
        self.fused_topk = bool(config.moe_router_fusion)
        if self.fused_topk:
            self.config = copy.copy(config)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Megatron's top-k routing; fused unless this forward replays (class docstring)."""
        if not self.fused_topk:
            return super().routing(logits, padding_mask)
        replaying = self.replay.active
        self.config.moe_router_fusion = not replaying
        probs, routing_map = super().routing(logits, padding_mask)
        if not replaying and self.replay.record:  # the fused kernel skipped _LayerReplay
            own = routing_map.to(torch.int8).topk(self.topk, dim=1).indices
            self.replay.recorded[self.moe_layer_index] = own.detach()
        return probs, routing_map

    @property
    def moe_layer_index(self) -> int:
        """0-based index among the MoE layers (every Qwen3-MoE layer is MoE)."""
        if self.layer_number is None:
            raise RuntimeError("ReplayTopKRouter: layer_number was never set by the layer")
        return self.layer_number - 1

    def token_shard(self) -> tuple[int, int]:
        """(rank, size) of the sequence-parallel split of the router's tokens."""
        if self.config.sequence_parallel and self.tp_group is not None and self.tp_group.size() > 1:
            return self.tp_group.rank(), self.tp_group.size()
        return 0, 1


def replay_spec_hook(replay: RoutingReplay) -> Callable[[Any, Any], Any]:
    """A ``spec_hook`` for ``models.builder`` that gives every MoE layer a replay router."""

    def hook(layer_spec: Any, config: Any) -> Any:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from megatron_qrl.models.spec_tree import copy_spec

        spec = copy_spec(layer_spec)
        if spec.submodules.mlp.module is not MoELayer:
            raise ValueError("--qrl-routing-replay needs an MoE model; this one is dense (use off)")
        if config.moe_router_pre_softmax is None:
            raise ValueError("moe_router_pre_softmax must be set")
        spec.submodules.mlp.submodules.router = functools.partial(ReplayTopKRouter, replay=replay)
        return spec

    return hook


def routing_agreement(trainer_ids: torch.Tensor, rollout_ids: torch.Tensor) -> torch.Tensor:
    """Per-layer mean fraction of the rollout's top-k experts the trainer also chose.

    ``trainer_ids`` / ``rollout_ids``: ``[tokens, layers, top_k]``. For token t and layer l,
    ``a_{t,l} = |E^train_{t,l} ∩ E^roll_{t,l}| / k``; returns ``mean_t a_{t,l}``, shape [layers].
    """
    if trainer_ids.shape != rollout_ids.shape or trainer_ids.dim() != 3:
        raise ValueError(f"routing_agreement: shapes {tuple(trainer_ids.shape)} and "
                         f"{tuple(rollout_ids.shape)} must be equal [tokens, layers, top_k]")
    match = (trainer_ids.unsqueeze(-1) == rollout_ids.unsqueeze(-2)).any(-1)
    return match.float().mean(dim=(0, 2))


def recorded_ids(replay: RoutingReplay, num_layers: int) -> torch.Tensor:
    """The trainer's own top-k of the last forward as ``[local tokens, num_layers, top_k]``."""
    missing = [i for i in range(num_layers) if i not in replay.recorded]
    if missing:
        raise RuntimeError(f"no routing recorded for MoE layers {missing}; run a forward first")
    return torch.stack([replay.recorded[i] for i in range(num_layers)], dim=1)
