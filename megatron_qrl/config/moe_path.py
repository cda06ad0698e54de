"""The MoE trainer's expert path: grouped GEMMs on a GPU with Transformer Engine, else sequential.

``--qrl-train-moe-fast-path`` (the ``qwen3-30b-a3b`` preset sets it) gives an MoE model the
fast path of megatron-core 0.16.1 where the Transformer Engine spec is built (TE imports, a GPU
is present, no ``--transformer-impl local``, no LoRA):

- ``moe_grouped_gemm``: ``TEGroupedMLP``, every local expert in one grouped GEMM (the aligned
  forward: ``te_quant.te_grouped``);
- ``moe_token_dispatcher_type alltoall``, ``moe_permute_fusion`` (TE's fused permute /
  unpermute) and ``moe_router_fusion`` (TE's fused top-k and aux-loss scores; a forward that
  replays the rollout's experts runs the unfused top-k, ``moe.ReplayTopKRouter``);
- ``recompute_granularity selective`` with ``recompute_modules ["moe_act"]`` (only the experts'
  SwiGLU outputs are recomputed in the backward) unless a ``--recompute-*`` flag was given.

``--qrl-train-moe-experts stacked`` replaces the experts (TE's or the sequential ones) by
``models.stacked_experts`` (one grouped GEMM per linear, no TE needed); without the TE spec the
fast path then changes nothing else (megatron-core 0.16.1's ``moe_act`` recompute calls TE's FP8
state even in BF16, so it needs TE to import).

Megatron flags given after ``--`` win. Where the TE spec is not built the experts run sequentially and :func:`moe_overrides` says so in its
note; an explicit ``--moe-grouped-gemm`` there is refused (``megatron_flags``, :func:`check_moe_flags`).
"""

from __future__ import annotations

from typing import Any

from .args import QrlArgumentError

FAST_PATH: tuple[tuple[str, Any], ...] = (
    ("moe_grouped_gemm", True),
    ("moe_token_dispatcher_type", "alltoall"),
    ("moe_permute_fusion", True),
    ("moe_router_fusion", True),
)
"""TransformerConfig fields of the fast expert path (module docstring)."""
FAST_RECOMPUTE: tuple[tuple[str, Any], ...] = (
    ("recompute_granularity", "selective"),
    ("recompute_modules", ("moe_act",)),
)
"""Activation recompute of the fast path where no ``--recompute-*`` flag was given."""
_RECOMPUTE = ("recompute_granularity", "recompute_method", "recompute_num_layers",
              "recompute_modules")


def check_moe_flags(settings: Any, lora_enabled: bool, moe_experts: str = "megatron") -> None:
    """Raise naming the flags for an expert path the trainer would not build as asked."""
    given = dict(settings.config_overrides)
    modules = given.get("recompute_modules") or ()
    if "moe_act" in modules and not given.get("moe_grouped_gemm") and moe_experts != "stacked":
        raise QrlArgumentError("--recompute-modules moe_act recomputes the grouped experts' "
                               "activation: add --moe-grouped-gemm (or --qrl-train-moe-experts "
                               "stacked), or recompute moe / mlp")
    from megatron_qrl.models.builder import use_transformer_engine  # (te_here patches it)

    if "moe_act" in modules and not use_transformer_engine():
        raise QrlArgumentError("--recompute-modules moe_act: megatron-core 0.16.1's "
                               "CheckpointWithoutOutput calls Transformer Engine's FP8 state, "
                               "which does not import here; recompute moe / mlp instead")
    if lora_enabled and moe_experts == "stacked":
        raise QrlArgumentError(
            "--qrl-train-moe-experts stacked with --qrl-lora-rank > 0: LoRA adapters on routed "
            "experts need one SequentialMLP linear per expert; use --qrl-train-moe-experts "
            "megatron or train without LoRA")
    if lora_enabled and given.get("moe_grouped_gemm"):
        raise QrlArgumentError(
            "--moe-grouped-gemm with --qrl-lora-rank > 0: LoRA adapters on routed experts run "
            "on megatron-core's local spec, one SequentialMLP linear per expert; drop "
            "--moe-grouped-gemm (the sequential path) or train without LoRA")


def _recompute(given: dict[str, Any]) -> dict[str, Any]:
    if any(k in given for k in _RECOMPUTE):
        return {}
    return {k: list(v) if isinstance(v, tuple | list) else v for k, v in FAST_RECOMPUTE}


def moe_overrides(settings: Any, fast: bool, is_moe: bool, lora: bool,
                  te_spec: bool, stacked: bool = False) -> tuple[dict[str, Any], str | None]:
    """``(TransformerConfig overrides, note)`` of the Megatron flags plus the fast path.

    ``fast``: ``--qrl-train-moe-fast-path``; ``te_spec``: the trainer builds the Transformer
    Engine spec; ``lora``: a LoRA run (local spec); ``stacked``: ``--qrl-train-moe-experts
    stacked`` (grouped GEMMs without TE; where the TE spec is not built nothing else of the fast
    path applies). ``note``: one line saying what of the fast path did not apply, else None.
    """
    given = dict(settings.config_overrides)
    if "recompute_modules" in given:  # TransformerConfig's field is a list
        given["recompute_modules"] = list(given["recompute_modules"])
    if stacked and is_moe and not lora:  # grouped experts (megatron's moe_act recompute check)
        given["moe_grouped_gemm"] = True
    if not (fast and is_moe):
        return given, None
    if stacked and not te_spec and not lora:
        return given, (
            "--qrl-train-moe-fast-path: the Transformer Engine spec is not built here; the "
            "stacked experts run with megatron-core's unfused permute and top-k, and no "
            "selective moe_act recompute unless a --recompute-* flag asks for it")
    if lora or not te_spec:
        why = ("LoRA runs on the local spec" if lora else
               "the Transformer Engine spec is not built here (no TE on a GPU, or "
               "--transformer-impl local)")
        return given, (f"--qrl-train-moe-fast-path: {why}; the MoE experts run sequentially "
                       "(SequentialMLP)")
    out = {k: v for k, v in FAST_PATH if k not in given}
    out.update(_recompute(given))
    out.update(given)
    return out, None
