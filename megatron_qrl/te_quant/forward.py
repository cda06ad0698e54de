"""From the ``--qrl-*`` configs to the trainer's model spec: aligned forward + routing replay.

``trainer_forward(TrainForwardConfig, rollout_format, RoutingReplayConfig, arch)`` returns the
one ``spec_hook`` (stacked experts where ``--qrl-train-moe-experts stacked``, then the aligned
linears, the replay routers, the KV rounding) to pass to ``models.runtime.build_model`` plus the two state objects the RL
loop drives: :class:`AlignedForwardState` (attach to the optimizer; ``only(())`` gives the
plain forward) and :class:`~megatron_qrl.moe.RoutingReplay` (``use(expert_ids, phase)``
around the pi_prox recompute and the update forward/backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
from megatron_qrl.quant import get_spec
from megatron_qrl.quant.kv_cache import get_kv_format
from megatron_qrl.te_quant.fp8_backward import BACKWARD_FLAG, WGRAD_FLAG
from megatron_qrl.te_quant.kv_core_attention import KVAlignState, kv_spec_hook
from megatron_qrl.te_quant.real_gemm import FLAG, DeviceInfo, device_info, select_gemm
from megatron_qrl.te_quant.spec_hook import SpecHook, aligned_spec_hook, compose_hooks
from megatron_qrl.te_quant.state import AlignedForwardState
from megatron_qrl.te_quant.te_recipes import te_config_overrides


@dataclass
class TrainerForward:
    """What the RL loop needs to build and drive the trainer model."""

    spec_hook: SpecHook | None
    """Pass to ``build_model(..., spec_hook=...)``; None: upstream spec."""
    aligned: AlignedForwardState | None
    """Set for ``--qrl-train-forward aligned`` on the fake-quant path."""
    replay: Any
    """``moe.RoutingReplay`` for MoE models (also in mode ``off``: it records the trainer's
    routing for the agreement metric); None for dense models."""
    config_overrides: dict[str, str]
    """``TransformerConfig`` fields of the Transformer Engine path (empty otherwise)."""
    kv: KVAlignState | None = None
    """Set for ``--qrl-train-forward aligned`` with a rounding ``--qrl-rollout-kv-cache``: the
    RL loop calls ``kv.set_micro_batch(loss_mask)`` before each micro batch's forward."""


def aligned_gemm(rollout_format: str, mode: str, te_recipe: bool | str = False,
                 device: DeviceInfo | None = None) -> str:
    """``--qrl-train-aligned-gemm`` resolved for this format and device (``fake`` or
    ``real``, :func:`~megatron_qrl.te_quant.real_gemm.select_gemm`); a TE recipe runs its
    own GEMMs, so ``real`` with one is refused."""
    if te_recipe:
        if mode == "real":
            raise ValueError(f"{FLAG} real: a Transformer Engine recipe runs its own GEMMs; "
                             f"use {FLAG} auto or drop the recipe")
        return "fake"
    return select_gemm(get_spec(rollout_format), device or device_info(), mode).gemm


def trainer_forward(train: Any, rollout_format: str, routing: Any, arch: ModelArch,
                    te_recipe: bool | str = False, kv_cache: str = "bf16") -> TrainerForward:
    """Build the trainer forward from ``TrainForwardConfig`` / ``RoutingReplayConfig``.

    ``te_recipe``: serve the aligned forward with a Transformer Engine recipe instead of the
    fake-quant linears; raises one clear error if no recipe reproduces ``rollout_format`` on
    this GPU (see :mod:`megatron_qrl.te_quant.te_recipes`); ``"approximate"`` also takes a
    recipe that differs only by rounding (speed measurements). ``kv_cache``: the rollout's
    KV-cache format (``--qrl-rollout-kv-cache``); with the aligned forward and a rounding
    format the core attention reads K/V as the engine's cache serves them
    (:mod:`megatron_qrl.te_quant.kv_core_attention`), also with BF16 weights.
    """
    from megatron_qrl.moe import RoutingReplay, replay_spec_hook

    aligned = kv = None
    overrides: dict[str, str] = {}
    stacked = train.moe_experts == "stacked"
    if stacked and te_recipe:
        raise ValueError("--qrl-train-moe-experts stacked: the stacked experts compute in torch, "
                         "outside a Transformer Engine recipe; serve the aligned forward with the "
                         "fake-quant linears (no TE recipe) or use --qrl-train-moe-experts megatron")
    if train.forward == "aligned":
        gemm = aligned_gemm(rollout_format, train.aligned_gemm, te_recipe)
        for flag, value in ((BACKWARD_FLAG, train.aligned_backward),
                            (WGRAD_FLAG, train.aligned_wgrad)):
            if value != "bf16" and te_recipe:
                raise ValueError(f"{flag} {value}: a Transformer Engine recipe runs its own "
                                 f"backward GEMMs; drop the recipe or use {flag} bf16")
        state = AlignedForwardState(rollout_format, gemm=gemm, backward=train.aligned_backward,
                                    wgrad=train.aligned_wgrad)
        state.keep_dequantized = train.aligned_keep_dequantized and gemm == "real"
        kv = KVAlignState(kv_cache) if get_kv_format(kv_cache).quantizes else None
        if not state.spec.quantizes_weights and kv is None:
            raise ValueError(f"--qrl-train-forward aligned needs a quantized --qrl-rollout-format"
                             f" or --qrl-rollout-kv-cache, got {rollout_format!r} and {kv_cache!r}")
        if state.spec.quantizes_weights and te_recipe:
            overrides = te_config_overrides(rollout_format, approximate=te_recipe == "approximate")
        elif state.spec.quantizes_weights:
            aligned = state  # (BF16 weights with a rounding KV cache: plain linears)
    elif te_recipe:
        raise ValueError("a TE recipe serves only --qrl-train-forward aligned")
    if stacked and not arch.is_moe:
        raise ValueError(f"--qrl-train-moe-experts stacked needs an MoE model; "
                         f"{arch.architecture} is dense (use megatron)")
    replay = None
    if arch.is_moe:
        replay = RoutingReplay(routing.replay, arch.num_experts, arch.moe_top_k)
    elif routing.replay != "off":
        raise ValueError(f"--qrl-routing-replay {routing.replay} needs an MoE model; "
                         f"{arch.architecture} is dense (use off)")
    # the stacked experts first: the aligned hook then swaps their linears (te_grouped)
    hook = compose_hooks(stacked_experts_spec_hook if stacked else None,
                         aligned and aligned_spec_hook(aligned),
                         replay and replay_spec_hook(replay), kv and kv_spec_hook(kv))
    return TrainerForward(hook, aligned, replay, overrides, kv)
