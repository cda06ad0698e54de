"""Rollout engines behind one interface: the reference engine (CPU/GPU, transformers) and
SGLang (``megatron_qrl.rollout_sglang``). Weights arrive as packed ``(hf_name, tensor)``
streams produced by :meth:`QuantSpec.pack_state_dict` — the same path for every engine."""

from .base import (
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    WeightManifest,
    WeightSyncError,
    tensor_checksum,
)

__all__ = [
    "GenerationOutput",
    "RolloutEngine",
    "SamplingParams",
    "WeightManifest",
    "WeightSyncError",
    "tensor_checksum",
]
