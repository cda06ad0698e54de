"""Megatron dist checkpoints that carry their HF config and tokenizer.

Layout of a checkpoint directory::

    megatron_qrl.json   metadata: architecture, dtype, saved layout, applied UAQ scale
    hf/                 the HF config.json + tokenizer files of the source model
    model/              megatron-core dist_checkpointing (torch_dist) shards; loadable at
                        any TP/EP that divides the model (megatron re-shards on load)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_qrl.models.hf_config import ModelArch, arch_from_dict
from megatron_qrl.models.hf_io import CheckpointReadError
from megatron_qrl.utils.disk import os_error_of

METADATA_NAME = "megatron_qrl.json"
FORMAT = "megatron_qrl.dist_ckpt.v1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_metadata(ckpt_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any], ModelArch]:
    """``(metadata, hf_config, arch)`` of a checkpoint written by :func:`save_checkpoint`."""
    root = Path(ckpt_dir)
    meta_path = root / METADATA_NAME
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{meta_path} not found: --megatron-dir must be a checkpoint written by "
            "tools/convert_hf_to_megatron.py")
    meta = _read_json(meta_path)
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt != FORMAT:
        raise ValueError(f"{meta_path}: format {fmt!r}, expected {FORMAT!r}")
    cfg_path = root / "hf" / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: the checkpoint lost its HF config")
    cfg = _read_json(cfg_path)
    return meta, cfg, arch_from_dict(cfg, str(cfg_path))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointReadError(f"{path}: not valid JSON ({exc}); the checkpoint is damaged: "
                                  "convert the model again") from None


def save_checkpoint(model: torch.nn.Module, out_dir: str | Path, metadata: dict[str, Any]) -> None:
    """Save ``model`` with dist_checkpointing into ``out_dir/model`` and write the metadata.

    ``out_dir/hf`` must already hold the HF side files. Collective over all ranks.
    """
    from megatron.core import dist_checkpointing

    from megatron_qrl.compat.dist_ckpt_cpu import cuda_synchronize_noop

    model_dir = Path(out_dir) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    with cuda_synchronize_noop():
        try:
            dist_checkpointing.save(model.sharded_state_dict(), str(model_dir))
        except (Exception, CheckpointException) as exc:
            os_error = os_error_of(exc)  # a full / read-only disk: the OSError, for one line
            if os_error is None:
                raise
            raise os_error from exc
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        meta = {"format": FORMAT, **metadata}
        (Path(out_dir) / METADATA_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True))


def load_checkpoint(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Load ``ckpt_dir/model`` into ``model`` (any TP/EP layout). Collective over all ranks."""
    from megatron.core import dist_checkpointing

    model_dir = Path(ckpt_dir) / "model"
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir} not found: not a megatron_qrl checkpoint directory")
    try:
        state = dist_checkpointing.load(model.sharded_state_dict(), str(model_dir))
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        raise CheckpointReadError(
            f"{model_dir}: the checkpoint shards cannot be read ({_cause(exc)}); a .distcp / "
            "metadata file is truncated or corrupted, or belongs to another model: convert the "
            "model again") from exc
    model.load_state_dict(state, strict=True)


def _cause(exc: BaseException) -> str:
    """``Type: message`` of the first failure inside a (torch) CheckpointException."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
