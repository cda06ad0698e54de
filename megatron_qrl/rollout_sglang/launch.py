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


def start_job_engine(rollout_cfg: Any, hf_config: dict, seed: int, **engine_kwargs: Any):
    """The SGLang engine of ``--qrl-rollout-engine sglang`` (placeholder weights until the
    first sync). ``rollout_cfg``: :class:`megatron_qrl.config.run.RolloutConfig`."""
    from .engine import SGLangEngine

    d = write_engine_dir(hf_config, rollout_cfg.format)
    sync = getattr(rollout_cfg, "sglang_sync", "auto")
    kwargs: dict[str, Any] = {"load_format": "dummy", "random_seed": seed,
                              "mem_fraction_static": getattr(rollout_cfg, "sglang_mem_fraction", 0.5)}
    if getattr(rollout_cfg, "sglang_release_memory", False):
        kwargs["enable_memory_saver"] = True  # release_memory_occupation frees memory only so
    if sync != "auto":
        kwargs["sync"] = sync
    if kwargs.get("sync") == "disk":
        kwargs["sync_dir"] = getattr(rollout_cfg, "sglang_sync_dir", "/dev/shm")
    for field, arg, unset in (("sglang_flat_buckets", "flatten_buckets", None),
                              ("sglang_prefetch_buckets", "prefetch_buckets", None),
                              ("sglang_direct_expert_loads", "direct_expert_loads", None),
                              ("sglang_stack_experts", "stack_experts", None)):
        value = getattr(rollout_cfg, field, unset)
        if value != unset:  # only what was set: the engine picks its default per sync
            kwargs[arg] = value
    base_gpu = getattr(rollout_cfg, "sglang_base_gpu", 0)
    if base_gpu or sync == "distributed":
        kwargs["base_gpu_id"] = base_gpu
    kwargs |= engine_kwargs
    return SGLangEngine(d, rollout_cfg.format, **kwargs)
