"""The rollout-engine interface every engine implements, and the weight-sync manifest
(:mod:`megatron_qrl.sync.protocol.checksums`, re-exported here).

Weight sync (trainer -> engine), identical for every engine::

    stream = spec.pack_state_dict(apply_aqn(iter_hf_tensors(model, arch), sigma, gen))
    manifest = WeightManifest()
    engine.update_weights(manifest.record(stream), version=step)
    engine.verify(manifest)          # raises WeightSyncError naming the first bad tensor

``manifest.record`` passes the stream through lazily while fingerprinting each tensor, so
nothing is materialised twice on the sender.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..sync.protocol.checksums import (  # noqa: F401  (the engine interface's sync vocabulary)
    Checksums,
    WeightManifest,
    WeightSyncError,
    checksum_parts,
    checksum_parts_many,
    checksum_rows,
    format_checksum,
    once_each,
    tensor_checksum,
)
from .capacity import EngineCapacity


@dataclass(frozen=True)
class SamplingParams:
    """Sampling controls shared by every engine (SGLang names where they exist)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k, as in SGLang."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings; needs an engine with a tokenizer (``decode``)."""
    seed: int | None = None
    group_size: int = 0
    """> 0 (with ``seed``): the prompts are consecutive prompt groups of this many rows, and
    group ``k`` is sampled from its own seed ``rollout.groups.group_seed(seed, k)``, so its
    samples do not depend on the other groups of the call nor on the engine serving it
    (``rollout.groups``); 0: the batch is sampled as one from ``seed``."""

    def __post_init__(self) -> None:
        if self.group_size < 0:
            raise ValueError(f"group_size must be >= 0, got {self.group_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationOutput:
    """One generate() call: ``B`` samples, right-padded to the longest response ``T``.

    ``routed_experts``: int [B, P + T, num_moe_layers, top_k] — the experts the engine's router
    chose for every prompt and response token (None for dense models or engines that cannot
    report them); prompt rows are left-aligned, padded with -1.
    """

    prompt_ids: list[list[int]]
    output_ids: torch.Tensor  # int64 [B, T], pad 0 past the end
    logprobs: torch.Tensor  # fp32 [B, T], log pi_behav of each sampled token, 0 past the end
    mask: torch.Tensor  # bool [B, T]
    finish_reasons: list[str]  # "stop" | "length"
    weight_version: int
    routed_experts: torch.Tensor | None = None

    def responses(self) -> list[list[int]]:
        """The generated token ids of each sample, without padding."""
        return [row[m].tolist() for row, m in zip(self.output_ids, self.mask)]


class RolloutEngine(ABC):
    """A generation engine that receives packed low-precision weights from the trainer."""

    verifies_own_update: bool = False
    """True for an engine whose :meth:`update_weights` checks the sync itself before returning
    (raising :class:`WeightSyncError` naming the tensor), so the driver's sync
    (:func:`megatron_qrl.rl.sync.sync_weights`) builds no :class:`WeightManifest`: the
    in-process SGLang engine, which compares the fingerprints its scheduler took of what it
    received with those of the stream it was handed (see its ``last_sync["verified"]``).
    False where the driver compares :meth:`held_checksums` with its manifest (the reference
    engine's parameters, a Ray actor's received tensors)."""

    stacked_experts: bool = False
    """True for an engine that takes each decoder layer's packed experts of one kind as one
    tensor ``[E, ...]`` named ``...experts.*.<proj>.<leaf>`` (the in-place SGLang sync with
    ``stack_experts``): the driver's sync then packs them stacked
    (``QuantSpec.pack_state_dict(stack_experts=True)``, no per-expert copies). Only read
    where :attr:`verifies_own_update` (a manifest holds per-expert names)."""

    quantizes_into: bool = False
    """True for an engine that quantizes the trainer's high-precision weights straight into
    its own memory (the SGLang direct sync, ``QuantSpec.quantize_into``): the driver's sync
    then hands it :func:`~megatron_qrl.quant.pack_stream.writer_stream` (weights as they are,
    cached quantizations packed, experts stacked with :attr:`stacked_experts`) instead of
    the packed stream. Only read where :attr:`verifies_own_update`."""

    reshares_stream: bool = False
    """True for an engine that hands the stream's tensors on to another process by CUDA IPC
    (the SGLang direct sync written by the engine, under its memory saver). PyTorch refuses
    to share a tensor its process itself received by CUDA IPC ("Attempted to send CUDA tensor
    received from another process"), so a Ray actor that receives the stream over the ipc
    transport hands such an engine copies of its own."""

    holds_stream_tensors: bool = False
    """True for an engine that keeps the stream's tensors across syncs where they are the
    same memory each time (the SGLang direct sync written by the engine with
    ``SGLangOptions.hold_trainer_tensors``): the driver's sync then streams the query / key /
    value split out of ``linear_qkv`` from persistent buffers (``PolicyTrainer.stream_buffers``)
    so that those are held too; for any other engine the buffers would be memory for nothing."""

    last_sync: dict | None = None
    """The engine's account of its last :meth:`update_weights`, where it keeps one (the
    in-process SGLang engine: requests sent, seconds per part, what it quantized and copied,
    how the result was verified); the RL step logs it (:func:`sync_record`)."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load the packed ``(hf_name, tensor)`` stream; afterwards ``weight_version() == version``."""

    @abstractmethod
    def held_checksums(self) -> dict[str, str]:
        """Fingerprints of the tensors the engine holds now (see :func:`tensor_checksum`)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample one response per prompt (repeat a prompt for group sampling)."""

    @abstractmethod
    def weight_version(self) -> int:
        """Version of the last completed :meth:`update_weights` (-1 before the first)."""

    def verify(self, manifest: WeightManifest) -> None:
        """Check that the engine holds exactly what ``manifest`` recorded."""
        manifest.compare(self.held_checksums())

    def capacity(self) -> EngineCapacity | None:
        """What the engine decodes at once (:class:`~megatron_qrl.rollout.capacity.EngineCapacity`);
        None where it has no fixed KV pool or batch limit (the reference engine, remote
        engines)."""
        return None

    def release_memory(self) -> None:
        """Free accelerator memory while the trainer runs (colocated mode); no-op by default."""

    def resume_memory(self) -> None:
        """Undo :meth:`release_memory`; no-op by default."""

    def shutdown(self) -> None:
        """Stop the engine; no-op by default."""


def sync_record(engine: object) -> dict[str, Any]:
    """``engine``'s :attr:`RolloutEngine.last_sync` as step metrics ``sync_<key>``: its
    numbers (``sync_buckets``, ``sync_request_s``, ``sync_write_s``, ...) and how the sync was
    verified (``sync_verified``); nothing for an engine that keeps no account."""
    last = getattr(engine, "last_sync", None)
    if not isinstance(last, dict):
        return {}
    return {f"sync_{k}": v for k, v in last.items()
            if k == "verified" or (isinstance(v, (int, float)) and not isinstance(v, bool))}
