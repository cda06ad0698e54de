"""Weight sync trainer -> engine, and the engine factory of the single-process driver.

The one sync path, identical for every engine (issue 6, item 1)::

    iter_hf_tensors -> apply_aqn (engine copy only) -> spec.pack_state_dict
        -> manifest.record -> engine.update_weights -> engine.verify

An engine whose fingerprints are of the very stream it was handed in this process
(``RolloutEngine.checksums_of_sent_stream``: the in-process SGLang engine) gets the stream
without the manifest: comparing it would compare each tensor with itself, and its per-tensor
pass cost about as much as the engine's own (1.3-1.6 s of a 30B-A3B fp8 sync on an H200, run
10). Names sent twice are refused either way.

The trainer's weights are never modified: AQN noise draws a new tensor for each norm gain
it perturbs (QeRL, ALGORITHMS.md), seeded by ``(seed, version)`` so a resumed run sends the
same noise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qrl.quant.aqn import AQNConfig, apply_aqn
from megatron_qrl.quant.spec import QuantSpec
from megatron_qrl.rollout.base import RolloutEngine, WeightManifest, once_each

__all__ = ["SyncResult", "make_engine", "sync_weights"]


@dataclass(frozen=True)
class SyncResult:
    """What one sync sent."""

    version: int
    num_tensors: int
    aqn_sigma: float


def sync_weights(hf_stream: Iterable[tuple[str, torch.Tensor]], engine: RolloutEngine,
                 spec: QuantSpec, version: int, aqn: AQNConfig | None = None, seed: int = 0,
                 aqn_step: int = 0, total_steps: int = 1) -> SyncResult:
    """Send ``hf_stream`` (the trainer's HF-named weights) to ``engine`` as ``version``.

    AQN (if enabled) uses the sigma of ``aqn_step`` of ``total_steps`` (QeRL's staged decay)
    and the generator ``AQNConfig.generator(seed, version)``. Raises
    :class:`megatron_qrl.rollout.WeightSyncError` naming the tensor if the engine holds
    something else afterwards.
    """
    sigma = aqn.sigma(aqn_step, total_steps) if aqn is not None else 0.0
    stream = hf_stream
    if sigma > 0.0:
        stream = apply_aqn(stream, sigma, AQNConfig.generator(seed, version))
    if engine.checksums_of_sent_stream:
        engine.update_weights(once_each(spec.pack_state_dict(stream)), version=version)
        sent = len(engine.held_checksums())
    else:
        manifest = WeightManifest()
        engine.update_weights(manifest.record(spec.pack_state_dict(stream)), version=version)
        engine.verify(manifest)
        sent = len(manifest.checksums)
    if engine.weight_version() != version:
        raise RuntimeError(f"engine reports weight version {engine.weight_version()} after an "
                           f"update to version {version}")
    return SyncResult(version, sent, sigma)


def make_engine(rollout_cfg: Any, hf_config: dict, seed: int) -> RolloutEngine:
    """The rollout engine named by ``--qrl-rollout-engine`` for the single-process driver."""
    if rollout_cfg.engine == "reference":
        from megatron_qrl.rollout.reference import ReferenceEngine

        return ReferenceEngine(hf_config, rollout_cfg.format, device="cpu",
                               dtype=torch.float32, seed=seed)
    if rollout_cfg.engine == "sglang":
        from megatron_qrl.rollout_sglang.launch import start_job_engine

        return start_job_engine(rollout_cfg, hf_config, seed)
    raise NotImplementedError(f"--qrl-rollout-engine {rollout_cfg.engine}: no such engine")
