"""Which trainer-side sync a weight version takes, chosen in one place (:class:`SyncPlan`).

Three ways to bring the engine to the trainer's weights, each with rank 0's side
(``send``) and the other ranks' side (``serve``: the collectives of the stream they take
part in):

- ``lora`` (:class:`~megatron_qrl.rl.lora_sync.LoraSync`): a LoRA run whose base is frozen
  (:attr:`~megatron_qrl.rl.forward.ForwardPlan.lora` ``.active``): the base once, then
  adapters only;
- ``sharded`` (:class:`~megatron_qrl.rl.ep_sync.ShardedSync`): trainer EP > 1 feeding a
  fleet whose groups take it (``sharded_sync_applies``): every EP rank sends its experts;
- ``gathered`` (:func:`~megatron_qrl.rl.sync.sync_weights`): the full HF tensors gathered
  to rank 0, which sends them (every other case).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_qrl.quant.aqn import AQNConfig
from megatron_qrl.quant.spec import QuantSpec
from megatron_qrl.rl.ep_sync import ShardedSync
from megatron_qrl.rl.lora_sync import LoraSync
from megatron_qrl.rl.qcache_sync import QCacheSync
from megatron_qrl.rl.sync import SyncResult, sync_weights

__all__ = ["SYNC_STRATEGIES", "SyncPlan"]

SYNC_STRATEGIES = ("lora", "sharded", "gathered")


@dataclass
class SyncPlan:
    """The job's trainer-side weight sync (module docstring)."""

    trainer: Any
    """The :class:`~megatron_qrl.rl.trainer.PolicyTrainer` whose weights are sent."""
    engine: Any
    """The rollout engine (rank 0; None on the other ranks)."""
    spec: QuantSpec
    aqn: AQNConfig | None
    seed: int
    sft_steps: int
    steps: int
    lora: LoraSync | None = None
    lora_plan: Any = None
    """The forward plan's LoRA part (``active`` once the base is frozen), with ``lora``."""
    sharded: ShardedSync | None = None
    qcache: QCacheSync | None = None
    """Whether the gathered sync packs the aligned forward's cached codes (None: never)."""

    def strategy(self) -> str:
        """The sync the next version takes: one of :data:`SYNC_STRATEGIES`."""
        if self.lora is not None and self.lora_plan is not None and self.lora_plan.active:
            return "lora"
        return "sharded" if self.sharded is not None else "gathered"

    def aqn_at(self, version: int) -> dict[str, int]:
        """AQN's step of ``version`` (its RL step, clamped) and the RL steps."""
        return {"aqn_step": min(max(version - self.sft_steps, 0), max(self.steps - 1, 0)),
                "total_steps": max(self.steps, 1)}

    def send(self, version: int) -> SyncResult:
        """Rank 0: sync the engine to the trainer's weights as ``version``."""
        how = self.strategy()
        if how == "lora":  # the base once, then adapters only
            return self.lora.send(self.trainer, self.engine, self.spec, version, self.aqn,
                                  self.seed, **self.aqn_at(version))
        if how == "sharded":
            return self.sharded.send(self.engine, version, **self.aqn_at(version))
        quantized = None if self.qcache is None else self.qcache.lookup(
            self.trainer.module, self.trainer.policy.arch)
        # an engine that quantizes into its own memory reads each tensor during the sync and
        # keeps none: the parameters go as themselves (no copy per sync); one that holds them
        # across syncs gets the query / key / value from persistent buffers too
        views = self.engine.quantizes_into and self.engine.verifies_own_update
        stream = self.trainer.hf_tensors(
            views=views, persistent=views and self.engine.holds_stream_tensors)
        result = sync_weights(stream, self.engine, self.spec,
                              version, self.aqn, self.seed, **self.aqn_at(version),
                              quantized=quantized)
        if quantized is None:
            return result
        return dataclasses.replace(result, cached=self.qcache.reused)

    def serve(self, version: int = 0) -> None:
        """A rank > 0: its part of rank 0's sync (the stream's gathers need every rank)."""
        how = self.strategy()
        if how == "lora":
            return self.lora.consume(self.trainer, self.aqn, **self.aqn_at(version))
        if how == "sharded":  # rank 0's header says which sync
            return self.sharded.serve()
        for _ in self.trainer.hf_tensors():
            pass
        return None

    def engine_restarted(self) -> None:
        """A restarted engine holds nothing: a LoRA run sends its base again."""
        if self.lora is not None:
            self.lora.base_sent = False
