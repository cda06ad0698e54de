"""Trainer side of the LoRA weight sync: the frozen base once, then adapters only.

Per sync (QeRL / rlquant LoRA RL; the engine keeps its quantized base and serves the adapter
on top, ``rollout/lora_adapters.py``)::

    first sync after the base froze:  base_hf_tensors -> (AQN) -> spec.pack_state_dict
                                      -> engine.update_weights -> verify      (sync.sync_weights)
    AQN on (or just switched off):    the norm gains only, noisy  -> engine.update_base_tensors
    every sync:                       adapter_tensors (PEFT names) -> WeightManifest
                                      -> engine.load_lora_adapter(name_v<version>, ...)
                                      -> compare with engine.held_lora_checksums()

The base never changes after :func:`megatron_qrl.models.lora.freeze_base`, so it is sent once;
a resumed run sends it again (``base_sent`` starts False). Every stream here is collective
over the trainer's TP / EP groups: ranks other than 0 call :meth:`LoraSync.consume`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qrl.models.lora_config import LoraConfig
from megatron_qrl.models.lora_io import adapter_tensors, base_hf_tensors
from megatron_qrl.quant.aqn import AQNConfig, apply_aqn, is_aqn_target
from megatron_qrl.quant.spec import QuantSpec
from megatron_qrl.rl.sync import SyncResult, sync_weights
from megatron_qrl.rollout.base import WeightManifest, WeightSyncError

__all__ = ["LoraSync"]


@dataclass
class LoraSync:
    """What the engine already holds of the LoRA policy (per process, every rank alike)."""

    config: LoraConfig
    base_sent: bool = False
    norms_noisy: bool = False
    adapter_syncs: int = 0

    def _plan(self, sigma: float) -> tuple[bool, bool]:
        """(send the whole base, send the norm gains)."""
        full = not self.base_sent
        return full, (not full) and (sigma > 0.0 or self.norms_noisy)

    def _norms(self, trainer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t) for n, t in base_hf_tensors(trainer.module, trainer.policy.arch,
                                                   trainer.policy.groups) if is_aqn_target(n))

    def _adapters(self, trainer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return adapter_tensors(trainer.module, trainer.policy.arch, trainer.policy.groups)

    def send(self, trainer: Any, engine: Any, spec: QuantSpec, version: int,
             aqn: AQNConfig | None, seed: int, aqn_step: int, total_steps: int) -> SyncResult:
        """Rank 0: bring ``engine`` to the trainer's policy as ``version`` (see module doc)."""
        if not hasattr(engine, "load_lora_adapter"):
            raise WeightSyncError(f"{type(engine).__name__} cannot serve LoRA adapters "
                                  "(no load_lora_adapter); run --qrl-lora-rank 0 on it")
        sigma = aqn.sigma(aqn_step, total_steps) if aqn is not None else 0.0
        full, norms = self._plan(sigma)
        if full:
            sync_weights(base_hf_tensors(trainer.module, trainer.policy.arch,
                                         trainer.policy.groups), engine, spec, version, aqn,
                         seed, aqn_step, total_steps)
            self.base_sent = True
        elif norms:
            stream = self._norms(trainer)
            if sigma > 0.0:
                stream = apply_aqn(stream, sigma, AQNConfig.generator(seed, version))
            engine.update_base_tensors(list(stream), version=version)
        self.norms_noisy = sigma > 0.0
        manifest = WeightManifest()
        tensors = dict(manifest.record(self._adapters(trainer)))
        engine.load_lora_adapter(f"policy_v{version}", tensors, self.config.peft_config(),
                                 version=version)
        manifest.compare(engine.held_lora_checksums())
        self.adapter_syncs += 1
        return SyncResult(version, len(manifest.checksums), sigma)

    def consume(self, trainer: Any, aqn: AQNConfig | None, aqn_step: int,
                total_steps: int) -> None:
        """Ranks other than 0: take part in the same gathers as :meth:`send`."""
        sigma = aqn.sigma(aqn_step, total_steps) if aqn is not None else 0.0
        full, norms = self._plan(sigma)
        streams = [base_hf_tensors(trainer.module, trainer.policy.arch, trainer.policy.groups)
                   ] if full else [self._norms(trainer)] if norms else []
        for stream in [*streams, self._adapters(trainer)]:
            for _ in stream:
                pass
        self.base_sent = True
        self.norms_noisy = sigma > 0.0


def enter_lora(trainer: Any, configs: dict[str, Any]) -> int:
    """Enter LoRA RL (idempotent; no-op without ``--qrl-lora-rank``): freeze every parameter
    but the adapters, move the base into ``--qrl-lora-base-format`` storage, adapters on.
    Call before the RL optimizer is made (it then holds the adapters only)."""
    plan = trainer.policy.plan
    if plan.lora is None or plan.lora.active:
        return 0
    from megatron_qrl.models.lora import freeze_base
    from megatron_qrl.models.lora_base import make_base_storage

    n = freeze_base(trainer.module, make_base_storage(configs["lora"].base_format))
    plan.lora.active = True
    return n
