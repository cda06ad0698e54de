"""Quantize once per optimizer step: the weight sync packs the aligned forward's cached codes.

With ``--qrl-train-forward aligned`` the trainer holds ``Q_w(W)`` of every quantized linear
(and of every grouped / stacked expert layer), computed once per optimizer step in the
rollout's format (QaRL, Fan et al. 2025). The sync would quantize every weight a second time
(``QuantSpec.pack_state_dict``); :class:`QCacheSync` decides once per job whether it may pack
the cached codes and scales instead, and per sync hands the packer the lookup
``hf_name -> QuantizedWeight`` (:func:`megatron_qrl.quant.pack_stream.pack_state_dict`'s
``quantized``). The sent bytes are then the cache's, bit for bit, and equal what quantizing
in the sync gives (``te_quant.qcodes``: one ``spec.quantize_weight`` per HF tensor either
way).

It applies when (a) the aligned forward runs on the fake-quant or real-GEMM linears (not a
Transformer Engine recipe, not LoRA), (b) its format is the rollout's, and (c) the trainer
is one unsharded model (tensor, expert and pipeline parallel size 1: a sharded cache holds
this rank's shards while the sync sends gathered tensors). Validity per sync: building the
lookup asks each module for its codes, which refreshes a cache older than the weights (the
optimizer-step version and the parameter's own version, :mod:`megatron_qrl.te_quant.state`)
before reading it, so stale codes are never sent; the forward after the sync then finds the
cache fresh. AQN perturbs norm gains only, never a quantized weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_qrl.models.mapping import rule_for
from megatron_qrl.quant import QuantizedWeight, QuantSpec

__all__ = ["QCacheSync", "cached_codes", "reuse_applies"]


def _sharded(groups: Any) -> bool:
    """True if ``groups`` (``models.streaming.ShardGroups`` or None) split the model."""
    if groups is None:
        return False
    if getattr(groups, "stage", None) is not None:
        return True
    for g in (getattr(groups, "tp", None), getattr(groups, "ep", None),
              getattr(groups, "etp", None)):
        if g is not None and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size(g) > 1:
            return True
    return False


def reuse_applies(aligned: Any, spec: QuantSpec, groups: Any = None) -> tuple[bool, str]:
    """(whether the sync packs the aligned forward's cached codes, why) for this job."""
    if not spec.quantizes_weights:
        return False, f"--qrl-rollout-format {spec.name} sends BF16 weights"
    if aligned is None:
        return False, ("no aligned-forward cache (--qrl-train-forward bf16, a Transformer "
                       "Engine recipe or LoRA)")
    if aligned.spec.name != spec.name:
        return False, (f"the aligned forward's format {aligned.spec.name} is not the rollout's "
                       f"{spec.name}")
    if _sharded(groups):
        return False, ("the trainer is sharded (tensor / expert / pipeline parallel > 1): its "
                       "cache holds this rank's shards, the sync sends whole tensors")
    if aligned.gemm == "real":
        return True, f"{spec.name}, the real GEMM's codes and scales"
    return True, f"{spec.name}, codes kept beside the fake GEMM's dequantized weights"


def cached_codes(model: torch.nn.Module, arch: Any) -> dict[str, QuantizedWeight]:
    """``hf_name -> QuantizedWeight`` of every quantized weight the aligned modules of
    ``model`` cache (each refreshed first if stale: ``qrl_codes``)."""
    out: dict[str, QuantizedWeight] = {}
    for mod_name, module in model.named_modules():
        get = getattr(module, "qrl_codes", None)
        codes = get() if callable(get) else None
        if not codes:
            continue
        per_weight = ([(f"{mod_name}.weight", codes)] if isinstance(codes[0], QuantizedWeight)
                      else [(f"{mod_name}.weight{e}", c) for e, c in enumerate(codes)])
        for param, parts in per_weight:
            out.update(zip(rule_for(param, arch).hf_names, parts, strict=True))
    return out


@dataclass
class QCacheSync:
    """The job's choice (:func:`reuse_applies`) and the last sync's counts."""

    aligned: Any
    """The model's ``te_quant.AlignedForwardState`` (or None)."""
    spec: QuantSpec
    reuses: bool
    reason: str
    reused: int = 0
    """Quantized HF tensors the last sync packed from the cache."""
    quantized: int = 0
    """Quantized HF tensors the last sync quantized itself (0 where it reuses)."""

    @classmethod
    def plan(cls, aligned: Any, spec: QuantSpec, groups: Any = None) -> QCacheSync:
        """Decide for the job; where reuse applies the fake GEMM's cache keeps its codes (call
        before the first forward, or the first sync quantizes the weights again)."""
        reuses, reason = reuse_applies(aligned, spec, groups)
        if reuses:
            aligned.keep_codes = True
        return cls(aligned, spec, reuses, reason)

    def describe(self) -> str:
        """The log's phrase: which path the sync's quantization takes and why."""
        how = "reused from the aligned forward's Q(W) cache" if self.reuses \
            else "quantized by the sync"
        return f"{how} ({self.reason})"

    def lookup(self, model: torch.nn.Module, arch: Any
               ) -> Callable[[str], QuantizedWeight | None] | None:
        """The packer's ``quantized`` for one sync of ``model`` (None: quantize everything),
        counting into :attr:`reused` / :attr:`quantized`."""
        self.reused = self.quantized = 0
        if not self.reuses:
            return None
        codes = cached_codes(model, arch)
        self.aligned.check_finite()  # what a refresh here (or the forward's) quantized

        def get(name: str) -> QuantizedWeight | None:
            q = codes.pop(name, None)  # (sent once: the reference goes with it)
            if q is None:
                self.quantized += 1
            else:
                self.reused += 1
            return q

        return get
