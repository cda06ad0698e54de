"""Impossible ``--qrl-lora-*`` combinations (one clear error each; see config/checks.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..quant import get_spec

__all__ = ["lora_problem"]


def _aligned(lora: Any, c: Mapping[str, Any]) -> str | None:
    fmt = c["rollout"].format
    if c["train"].forward != "aligned":
        return None
    if lora.base_format != fmt:
        return (f"--qrl-lora-rank {lora.rank} with --qrl-train-forward aligned: the frozen base "
                f"is the aligned forward, so --qrl-lora-base-format must be the rollout's "
                f"format ({fmt}), got {lora.base_format}; set --qrl-lora-base-format {fmt} or "
                "use --qrl-train-forward bf16")
    if get_spec(fmt).quantizes_activations:
        return (f"--qrl-lora-rank {lora.rank} with --qrl-train-forward aligned and W8A8 "
                f"--qrl-rollout-format {fmt}: the LoRA linears do not quantize activations; "
                "use a weight-only format (w4a16, nvfp4) or --qrl-train-forward bf16")
    return None


def _engine(lora: Any, c: Mapping[str, Any]) -> str | None:
    if c["rollout"].engine != "reference":
        return (f"--qrl-lora-rank {lora.rank} with --qrl-rollout-engine {c['rollout'].engine}: "
                "the adapter sync into SGLang is not wired into the driver yet "
                "(megatron_qrl/rollout_sglang/lora.py is GPU-untested); use "
                "--qrl-rollout-engine reference")
    if lora.experts:
        return ("--qrl-lora-experts with --qrl-rollout-engine reference: the reference engine "
                "serves adapters on nn.Linear layers only (not on fused experts); drop "
                "--qrl-lora-experts")
    return None


def lora_problem(c: Mapping[str, Any], env: Any = None) -> str | None:
    """The first impossible LoRA combination in ``c`` (None when LoRA is off or fine)."""
    lora = c.get("lora")
    if lora is None or not lora.enabled:
        return None
    if c["uaq"].enabled:
        return (f"--qrl-uaq-scale {c['uaq'].scale} with --qrl-lora-rank {lora.rank}: UAQ "
                "rescales the base, which LoRA freezes; apply it to the checkpoint first "
                "(megatron_qrl.quant.uaq.apply_uaq on its HF tensors) and drop --qrl-uaq-scale")
    return _aligned(lora, c) or _engine(lora, c)
