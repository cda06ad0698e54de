"""What an SGLang transport needs from the engine for one sync: the typed
:class:`SGLangSession` (the transports never see :class:`~megatron_qrl.rollout_sglang.
engine.SGLangEngine` itself). Runs in the trainer's process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_qrl.sync.protocol.checksums import Checksums

from ...quant.spec import QuantSpec
from ..options import SGLangOptions
from .distributed import WeightGroup

__all__ = ["SGLangSession"]


@dataclass
class SGLangSession:
    """One sync to one in-process SGLang engine."""

    options: SGLangOptions
    """The engine's options, resolved for its format (``sync`` names the transport)."""
    spec: QuantSpec
    device: torch.device
    """Where the trainer's tensors go before they are sent (the trainer's device)."""
    bucket_bytes: int
    processes: int
    """The engine's scheduler processes (TP ranks): each writes a receipt."""
    model_path: Path
    """The engine's HF directory (side files of a disk sync)."""
    sent: Checksums
    """Fingerprints of the stream as handed to the transport (filled while it sends)."""
    receipt: str | None
    """Where the engine's processes write their receipts (None: no receipt)."""
    lap: dict
    """The engine's ``last_sync`` record: ``buckets`` and where the time went."""
    serialize: Callable[[list], Any]
    """A request's tensors as SGLang's per-rank payload (CUDA-IPC handles)."""
    request: Callable[[str, Any, str], tuple[bool, str]]
    """``(tokenizer-manager method, request, first tensor name) -> (ok, message)``, timed
    into ``lap["request_s"]``; a dead engine is ``EngineDiedError``."""
    call: Callable[[str, Any], tuple[bool, str]]
    """The same call without the request bookkeeping (the disk sync's load)."""
    weight_group: Callable[[], WeightGroup]
    """The engine's weight-update group (formed on first use)."""
    storage: Callable[..., dict] | None = None
    """A request to the engine's storage service (``({"what": ..., "version": ...}[,
    tensors])`` -> answer; :func:`~.storage_client.storage_request`), None where the engine
    has none."""
    state: dict = field(default_factory=dict)
    """What a transport keeps for this engine across syncs (the direct sync's open storage)."""
