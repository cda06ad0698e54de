"""Impossible ``--qrl-lora-*`` combinations (one clear error each; see config/checks.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..quant import get_spec

__all__ = ["lora_problem"]


def _aligned(lora: Any, c: Mapping[str, Any]) -> str | None:
    """The aligned forward with LoRA needs a weight-only rollout format that is also the
    base's storage. Activation quantization is checked first, so that no refusal suggests a
    base format the next check refuses."""
    fmt = c["rollout"].format
    if c["train"].forward != "aligned":
        return None
    if get_spec(fmt).quantizes_activations:
        return (f"--qrl-lora-rank {lora.rank} with --qrl-train-forward aligned and W8A8 "
                f"--qrl-rollout-format {fmt}: the LoRA linears do not quantize activations; "
                "use --qrl-train-forward bf16, or a weight-only format held by the base too "
                "(--qrl-rollout-format w4a16 --qrl-lora-base-format w4a16, or nvfp4 for both)")
    if lora.base_format != fmt:
        return (f"--qrl-lora-rank {lora.rank} with --qrl-train-forward aligned: the frozen base "
                f"is the aligned forward, so --qrl-lora-base-format must be the rollout's "
                f"format ({fmt}), got {lora.base_format}; set --qrl-lora-base-format {fmt} or "
                "use --qrl-train-forward bf16")
    return None


def _expert_path(lora: Any, c: Mapping[str, Any], env: Any) -> str:
    """``adapter`` or ``merge``: how the run's engine gets routed-expert adapters."""
    from ..rollout.lora_serving import resolve_lora_serving

    cap = getattr(env, "gpu_capability", None)
    return resolve_lora_serving(c["rollout"].engine, c["rollout"].format, lora.targets,
                                is_moe=True, experts=True, capability=cap).experts


def _engine(lora: Any, c: Mapping[str, Any], env: Any) -> str | None:
    engine = c["rollout"].engine
    if engine == "sglang" and c["rollout"].sglang.sync not in ("auto", "inplace"):
        return (f"--qrl-lora-rank {lora.rank} with --qrl-rollout-sglang-sync "
                f"{c['rollout'].sglang.sync}: a LoRA-serving SGLang engine wraps its layers, "
                "so its base is loaded through the in-place loader; use "
                "--qrl-rollout-sglang-sync inplace (or auto)")
    if lora.experts and c["train"].forward == "aligned" and _expert_path(lora, c, env) == "merge":
        where = ("the reference engine holds fused experts" if engine == "reference" else
                 f"SGLang 0.5.17 serves no expert LoRA with {c['rollout'].format} on this GPU")
        return (f"--qrl-lora-experts with --qrl-rollout-engine {engine}: {where}, so the expert "
                "adapters are merged into its base and re-quantized "
                "(megatron_qrl/rollout/lora_serving.py), which the trainer's aligned forward "
                "(quantized base + adapter on top) does not reproduce; use "
                "--qrl-train-forward bf16 or drop --qrl-lora-experts")
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
    return _aligned(lora, c) or _engine(lora, c, env)
