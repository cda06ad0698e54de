"""Start an SGLang rollout engine for an RL job whose weights live in the trainer.

The engine starts on a directory holding only ``config.json`` (the job's HF config, BF16,
plus the format's ``quantization_config``) with ``load_format="dummy"``: SGLang builds the
format's layers with placeholder values, and the driver's first weight sync (all tensors,
checked by ``weight_version``) replaces every one of them before the first rollout. No
checkpoint is written or read.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..quant import get_spec
from .options import SGLangOptions

__all__ = ["engine_config", "start_job_engine", "write_engine_dir"]


def engine_config(hf_config: dict, spec_name: str) -> dict:
    """``config.json`` for an engine of ``spec_name``: BF16 activations, the format's
    ``quantization_config`` (absent for bf16)."""
    cfg = dict(hf_config)
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("quantization_config", None)
    q = get_spec(spec_name).hf_quantization_config()
    if q is not None:
        cfg["quantization_config"] = q
    return cfg


def write_engine_dir(hf_config: dict, spec_name: str, root: str | Path | None = None) -> Path:
    """A fresh directory with ``config.json`` and ``generation_config.json`` (atomic files)."""
    d = Path(tempfile.mkdtemp(prefix=f"qrl-sglang-{spec_name}-", dir=root))
    for name, obj in (("config.json", engine_config(hf_config, spec_name)),
                      ("generation_config.json", {"do_sample": True})):
        tmp = d / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, d / name)
    return d


def start_job_engine(options: SGLangOptions, spec_name: str, hf_config: dict, seed: int,
                     **engine_kwargs: Any):
    """The SGLang engine of ``--qrl-rollout-engine sglang`` (placeholder weights until the
    first sync): a config-only directory for ``spec_name``, ``load_format="dummy"``, the
    job's ``seed``; ``options`` go to the engine whole."""
    from .engine import SGLangEngine

    cls = SGLangEngine
    if "lora_rank" in engine_kwargs:  # a LoRA run: the adapter-serving engine
        from .lora import SGLangLoraEngine as cls
    d = write_engine_dir(hf_config, spec_name)
    kwargs: dict[str, Any] = {"load_format": "dummy", "random_seed": seed} | engine_kwargs
    return cls(d, spec_name, options, **kwargs)
