"""Trainer side of the LoRA weight sync: the frozen base once, then adapters only.

Per sync (QeRL / rlquant LoRA RL; the engine keeps its quantized base and serves the adapter
on top, ``rollout/lora_adapters.py``)::

    first sync after the base froze:  base_hf_tensors -> (AQN) -> spec.pack_state_dict
                                      -> engine.update_weights -> verify      (sync.sync_weights)
    AQN on (or just switched off):    the norm gains only, noisy  -> engine.update_base_tensors
    every sync:                       adapter_tensors (PEFT names) -> WeightManifest
                                      -> serving.split: adapter | merge (rollout/lora_serving.py)
      merge:   base of the touched engine modules + (alpha/r) B A -> spec.pack_state_dict
               -> engine.update_packed_tensors -> verify (receipt, or held_checksums)
      adapter: engine.load_lora_adapter(policy_v<version>, ...)
               -> compare with engine.held_lora_checksums()

The base never changes after :func:`megatron_qrl.models.lora.freeze_base`, so it is sent once;
a resumed run sends it again (``base_sent`` starts False). Every stream here is collective
over the trainer's TP / EP groups: ranks other than 0 call :meth:`LoraSync.consume`.

Under pipeline parallelism every stream is each stage's own (its layers' base tensors,
adapters and merged weights under their global names) and reaches rank 0 stage by stage
through :func:`megatron_qrl.rl.pipeline.stream_to_main`; a stage merges its own adapters into
its own base, so no rank gathers the model. Whether a sync has a merge part is agreed over
the pipeline group (:func:`megatron_qrl.rl.pipeline.any_stage`): one stage may hold no merged
adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qrl.config.configs import QrlConfigs
from megatron_qrl.models.lora_config import LoraConfig
from megatron_qrl.models.lora_io import adapter_tensors, base_hf_tensors, merge_into
from megatron_qrl.quant.aqn import AQNConfig, apply_aqn, is_aqn_target
from megatron_qrl.quant.spec import QuantSpec
from megatron_qrl.rl.pipeline import any_stage, stream_to_main
from megatron_qrl.rl.sync import SyncResult, sync_weights
from megatron_qrl.rollout.base import WeightManifest, WeightSyncError, once_each
from megatron_qrl.rollout.lora_serving import LoraServing, hf_weight_of
from megatron_qrl.utils.hf_names import parse

__all__ = ["LoraSync"]


def _stage(trainer: Any) -> Any:
    """The trainer's pipeline stage (None: one stage)."""
    stage = getattr(trainer.policy.groups, "stage", None)
    return stage if stage is not None and stage.size > 1 else None


def _to_main(trainer: Any, stream: Iterator[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` of this stage; under PP every stage's on rank 0 (module docstring)."""
    stage = _stage(trainer)
    return stream if stage is None else stream_to_main(stage, stream)


@dataclass
class LoraSync:
    """What the engine already holds of the LoRA policy (per process, every rank alike)."""

    config: LoraConfig
    serving: LoraServing | None = None
    """Which adapters the engine serves and which it gets merged (None: all served)."""
    base_sent: bool = False
    norms_noisy: bool = False
    adapter_syncs: int = 0

    def _plan(self, sigma: float) -> tuple[bool, bool]:
        """(send the whole base, send the norm gains)."""
        full = not self.base_sent
        return full, (not full) and (sigma > 0.0 or self.norms_noisy)

    def _base(self, trainer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return base_hf_tensors(trainer.module, trainer.policy.arch, trainer.policy.groups)

    def _norms(self, trainer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t) for n, t in self._base(trainer) if is_aqn_target(n))

    def _adapters(self, trainer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return adapter_tensors(trainer.module, trainer.policy.arch, trainer.policy.groups)

    def send(self, trainer: Any, engine: Any, spec: QuantSpec, version: int,
             aqn: AQNConfig | None, seed: int, aqn_step: int, total_steps: int) -> SyncResult:
        """Rank 0: bring ``engine`` to the trainer's policy as ``version`` (see module doc)."""
        sigma = aqn.sigma(aqn_step, total_steps) if aqn is not None else 0.0
        full, norms = self._plan(sigma)
        if full:
            sync_weights(_to_main(trainer, self._base(trainer)), engine, spec, version, aqn,
                         seed, aqn_step, total_steps)
            self.base_sent = True
        elif norms:
            stream = _to_main(trainer, self._norms(trainer))
            if sigma > 0.0:
                stream = apply_aqn(stream, sigma, AQNConfig.generator(seed, version))
            engine.update_base_tensors(list(stream), version=version)
        self.norms_noisy = sigma > 0.0
        manifest = WeightManifest()
        tensors = dict(manifest.record(_to_main(trainer, self._adapters(trainer))))
        served, merged = self.serving.split(tensors) if self.serving else (tensors, {})
        if any_stage(_stage(trainer), bool(merged)):
            self._send_merged(trainer, engine, spec, merged, version)
        if served:
            self._send_adapter(engine, served, manifest, version)
        self.adapter_syncs += 1
        return SyncResult(version, len(manifest.checksums), sigma,
                          adapter_bytes=sum(t.numel() * t.element_size() for t in tensors.values()))

    def _send_adapter(self, engine: Any, served: dict, manifest: WeightManifest,
                      version: int) -> None:
        if not hasattr(engine, "load_lora_adapter"):
            raise WeightSyncError(f"{type(engine).__name__} cannot serve LoRA adapters "
                                  "(no load_lora_adapter); run --qrl-lora-rank 0 on it")
        config = self.config.peft_config()
        if self.serving is not None:  # the engine's LoRA targets (merged ones left out)
            config["target_modules"] = [t for t in config["target_modules"]
                                        if t in self.serving.engine_targets]
        engine.load_lora_adapter(f"policy_v{version}", served, config, version=version)
        WeightManifest({k: manifest.checksums[k] for k in served}).compare(
            engine.held_lora_checksums())

    def _merged_stream(self, trainer: Any, merged: dict) -> Iterator[tuple[str, torch.Tensor]]:
        """``W0 + (alpha/r) B A`` of every tensor of the engine modules ``merged`` touches
        (collective: every rank iterates its base; under PP each stage merges its own layers
        and rank 0 yields every stage's)."""
        touched = {parse(hf_weight_of(n)).engine_module for n in merged}
        picked = ((n, t) for n, t in self._base(trainer)
                  if (p := parse(n)) is not None and p.engine_module in touched)
        return _to_main(trainer, merge_into(picked, merged, self.config.scaling))

    def _send_merged(self, trainer: Any, engine: Any, spec: QuantSpec, merged: dict,
                     version: int) -> None:
        """The ``merge`` path: merged, re-quantized tensors of the touched modules, in place."""
        if not hasattr(engine, "update_packed_tensors"):
            raise WeightSyncError(f"{type(engine).__name__} cannot take merged LoRA tensors "
                                  "(no update_packed_tensors)")
        packed = spec.pack_state_dict(self._merged_stream(trainer, merged))
        if engine.verifies_own_update:
            engine.update_packed_tensors(once_each(packed, set()), version=version)
            return
        sent = WeightManifest()
        engine.update_packed_tensors(sent.record(packed), version=version)
        sent.compare(engine.held_checksums())

    def consume(self, trainer: Any, aqn: AQNConfig | None, aqn_step: int,
                total_steps: int) -> None:
        """Ranks other than 0: take part in the same gathers (and, under PP, stage sends) as
        :meth:`send`."""
        sigma = aqn.sigma(aqn_step, total_steps) if aqn is not None else 0.0
        full, norms = self._plan(sigma)
        streams = [self._base(trainer)] if full else [self._norms(trainer)] if norms else []
        for stream in streams:
            for _ in _to_main(trainer, stream):
                pass
        local = list(self._adapters(trainer))
        for _ in _to_main(trainer, iter(local)):
            pass
        merged = self.serving.split(dict(local))[1] if self.serving else {}
        if any_stage(_stage(trainer), bool(merged)):  # as _send_merged on rank 0
            for _ in self._merged_stream(trainer, merged):
                pass
        self.base_sent = True
        self.norms_noisy = sigma > 0.0


def enter_lora(trainer: Any, configs: QrlConfigs) -> int:
    """Enter LoRA RL (idempotent; no-op without ``--qrl-lora-rank``): freeze every parameter
    but the adapters, move the base into ``--qrl-lora-base-format`` storage, adapters on.
    Call before the RL optimizer is made (it then holds the adapters only)."""
    plan = trainer.policy.plan
    if plan.lora is None or plan.lora.active:
        return 0
    from megatron_qrl.models.lora import freeze_base
    from megatron_qrl.models.lora_base import make_base_storage

    n = freeze_base(trainer.module, make_base_storage(configs.lora.base_format))
    plan.lora.active = True
    return n
