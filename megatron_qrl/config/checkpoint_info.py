"""Read a starting checkpoint's HF config and metadata without loading its weights.

Two layouts are understood (``--qrl-checkpoint DIR``):

* a megatron_qrl checkpoint (``tools/convert_hf_to_megatron``): ``DIR/megatron_qrl.json``
  (metadata, e.g. the applied ``uaq_scale``) and ``DIR/hf/config.json``;
* an HF directory: ``DIR/config.json`` and ``DIR/*.safetensors``, whose header metadata
  (strings) of every shard is merged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MEGATRON_QRL_METADATA", "is_moe_config", "read_checkpoint_info"]

MEGATRON_QRL_METADATA = "megatron_qrl.json"
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _load_json(path: Path, flag: str) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: {path} not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag}: {path} must hold a JSON object")
    return data


def _safetensors_metadata(root: Path, flag: str) -> dict[str, Any]:
    from safetensors import SafetensorError, safe_open

    meta: dict[str, Any] = {}
    for shard in sorted(root.glob("*.safetensors")):
        try:
            with safe_open(str(shard), framework="pt") as f:
                meta.update(f.metadata() or {})
        except SafetensorError as exc:
            raise ValueError(f"{flag} {root}: {shard} is not a readable safetensors file "
                             f"({exc}); it is truncated or corrupted: copy or convert it "
                             "again") from None
    return meta


def read_checkpoint_info(path: str | Path, flag: str = "--qrl-checkpoint") -> tuple[dict, dict]:
    """``(metadata, hf_config)`` of the checkpoint directory ``path`` (see module docstring)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{flag} {root}: no such directory")
    if (root / MEGATRON_QRL_METADATA).is_file():
        return _load_json(root / MEGATRON_QRL_METADATA, flag), _load_json(root / "hf" / "config.json", flag)
    return _safetensors_metadata(root, flag), _load_json(root / "config.json", flag)


def is_moe_config(config: dict[str, Any]) -> bool:
    """True when an HF config declares routed experts (``num_experts`` and its aliases > 0)."""
    return any(int(config.get(k) or 0) > 0 for k in _EXPERT_KEYS)
