"""Weight sync trainer -> engine (and the single-process driver's engine factory,
:func:`megatron_qrl.rollout_sglang.factory.make_engine`).

The one sync path, identical for every engine::

    iter_hf_tensors -> apply_aqn (engine copy only) -> spec.pack_state_dict
        -> manifest.record -> engine.update_weights -> engine.verify

An engine that quantizes into its own memory (``RolloutEngine.quantizes_into``: the SGLang
direct sync) takes :func:`~megatron_qrl.quant.pack_stream.writer_stream` instead of the
packed stream: the weights as they are (it quantizes each into its storage), the aligned
forward's cached codes packed as they are.

An engine that checks its own updates (``RolloutEngine.verifies_own_update``: the in-process
SGLang engine compares its scheduler's receipt with the fingerprints of the stream it was
handed) gets the stream without the manifest, a second per-tensor pass over the same stream
(1.3-1.6 s of a 30B-A3B fp8 sync on an H200). Names sent twice are refused either
way. Such an engine may also take expert stacks (``RolloutEngine.stacked_experts``): the
packed experts then leave ``pack_state_dict`` stacked per layer and kind, without
per-expert copies.

Before anything is sent, :func:`refuse_non_finite` checks the trainer's parameters on every
rank: a NaN / inf weight is ONE error naming the parameter, and the engine is left untouched
(it keeps serving the last good version).

The trainer's weights are never modified: AQN noise draws a new tensor for each norm gain
it perturbs (QeRL, docs/ALGORITHMS.md), seeded by ``(seed, version)`` so a resumed run sends the
same noise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qrl.quant.aqn import AQNConfig, apply_aqn
from megatron_qrl.quant.pack_stream import Quantized, writer_stream
from megatron_qrl.quant.spec import QuantSpec
from megatron_qrl.rollout.base import RolloutEngine, WeightManifest, once_each
from megatron_qrl.rollout_sglang.factory import make_engine
from megatron_qrl.utils import hf_names

__all__ = ["NonFiniteWeightsError", "SyncResult", "make_engine", "refuse_non_finite",
           "sync_weights"]


class NonFiniteWeightsError(RuntimeError):
    """The trainer holds NaN / inf weights; nothing was sent to the engine."""


def refuse_non_finite(named_params: Iterable[tuple[str, torch.Tensor]], version: int,
                      agree: Any = None) -> None:
    """Raise :class:`NonFiniteWeightsError` before the sync of ``version`` when a parameter
    holds a NaN / inf. ``agree(local_name_or_None)``: the first bad name over every rank
    (a multi-rank job; None: this process alone)."""
    bad = first_non_finite(named_params)
    if agree is not None:
        bad = agree(bad)
    if bad is not None:
        raise NonFiniteWeightsError(
            f"weight sync of version {version} refused: the trainer's parameter {bad} holds "
            "NaN / inf values, the engine keeps its last weights; lower --qrl-lr / "
            "--qrl-sft-lr, or check --qrl-max-update-ratio and the start checkpoint")


def first_non_finite(named_params: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The first of ``named_params`` holding a NaN / inf, or None: each parameter's max ``|x|``
    (``vector_norm`` of order inf, which propagates NaN and inf) checked together
    (:class:`~megatron_qrl.quant.finite_checks.FiniteChecks`: one host sync per device, not
    one per parameter, ~400 for a 4B model)."""
    from megatron_qrl.quant.finite_checks import FiniteChecks

    checks = FiniteChecks()
    for name, t in named_params:
        if t.numel() and t.is_floating_point():  # integers are finite
            checks.add_amax(name, torch.linalg.vector_norm(t.detach(), ord=float("inf")))
    return checks.first_bad()


@dataclass(frozen=True)
class SyncResult:
    """What one sync sent."""

    version: int
    num_tensors: int
    aqn_sigma: float
    adapter_bytes: int | None = None
    """LoRA runs: bytes of the adapter tensors this sync sent (None: a full-weight sync)."""
    cached: int | None = None
    """Quantized weights packed from the aligned forward's Q(W) cache, not quantized again
    (:mod:`megatron_qrl.rl.qcache_sync`; None: the sync quantized every weight)."""


def sync_weights(hf_stream: Iterable[tuple[str, torch.Tensor]], engine: RolloutEngine,
                 spec: QuantSpec, version: int, aqn: AQNConfig | None = None, seed: int = 0,
                 aqn_step: int = 0, total_steps: int = 1,
                 quantized: Quantized | None = None) -> SyncResult:
    """Send ``hf_stream`` (the trainer's HF-named weights) to ``engine`` as ``version``.

    AQN (if enabled) uses the sigma of ``aqn_step`` of ``total_steps`` (QeRL's staged decay)
    and the generator ``AQNConfig.generator(seed, version)``. Raises
    :class:`megatron_qrl.rollout.WeightSyncError` naming the tensor if the engine holds
    something else afterwards. ``quantized``: the weights' quantizations computed already
    (the aligned forward's cache, :mod:`megatron_qrl.rl.qcache_sync`), packed as they are.
    """
    sigma = aqn.sigma(aqn_step, total_steps) if aqn is not None else 0.0
    stream = hf_stream
    if sigma > 0.0:
        stream = apply_aqn(stream, sigma, AQNConfig.generator(seed, version))
    if engine.verifies_own_update:
        rows: dict[str, int] = {}
        if engine.quantizes_into:
            packed = writer_stream(spec, stream, quantized=quantized,
                                   stack_experts=engine.stacked_experts)
        else:
            packed = spec.pack_state_dict(stream, stack_experts=engine.stacked_experts,
                                          quantized=quantized)
        engine.update_weights(_counted(once_each(packed), rows, spec), version=version)
        sent = sum(rows.values())
    else:
        manifest = WeightManifest()
        engine.update_weights(manifest.record(spec.pack_state_dict(stream, quantized=quantized)),
                              version=version)
        engine.verify(manifest)
        sent = len(manifest.checksums)
    if engine.weight_version() != version:
        raise RuntimeError(f"engine reports weight version {engine.weight_version()} after an "
                           f"update to version {version}")
    return SyncResult(version, sent, sigma)


def _counted(stream: Iterable[tuple[str, torch.Tensor]], rows: dict[str, int],
             spec: QuantSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` unchanged; ``rows[name]``: the packed tensors ``name`` stands for (an expert
    stack's experts; a weight still to be quantized by the engine, its packed tensors)."""
    for name, t in stream:
        p = hf_names.parse(name)
        stacked = p is not None and p.is_stacked
        unit = hf_names.expert_name(name, 0) if stacked else name
        per = (len(spec.packed_names(unit)) if t.dtype.is_floating_point
               and t.element_size() > 1 and spec.is_quantized(unit) else 1)
        rows[name] = per * (t.shape[0] if stacked else 1)
        yield name, t
