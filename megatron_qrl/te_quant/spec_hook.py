"""Swap the quantized linears of a decoder-layer ``ModuleSpec`` for rollout-aligned ones.

Megatron's mechanism for choosing layer implementations is the ``ModuleSpec``; the hook returned
by :func:`aligned_spec_hook` maps the layer spec built by ``models.builder`` (local or
Transformer Engine backend) to one whose attention ``linear_qkv`` / ``linear_proj``, dense MLP
``linear_fc1`` / ``linear_fc2`` and expert ``linear_fc1`` / ``linear_fc2`` are
:class:`~megatron_qrl.te_quant.linears.AlignedColumnParallelLinear` /
:class:`~megatron_qrl.te_quant.linears.AlignedRowParallelLinear`. The router, embeddings, norms
and the output layer are untouched (BF16, as in the rollout). No Megatron class is patched.

On the Transformer Engine spec every TE linear is replaced by its name-keeping aligned
stand-in (:mod:`megatron_qrl.te_quant.te_names`: the fused ``TELayerNormColumnParallelLinear``
keeps ``layer_norm_weight`` and computes the norm itself; :mod:`megatron_qrl.te_quant.te_grouped`:
``TEGroupedMLP`` keeps ``linear_fc1.weight{i}``; the stacked experts of
``models.stacked_experts`` keep their one stacked weight per linear), so parameter names, state-dict keys and
torch_dist checkpoints are the TE spec's in both forward modes. TE FP8 recipes are a separate,
opt-in path (:mod:`megatron_qrl.te_quant.te_recipes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_qrl.models.spec_tree import copy_spec
from megatron_qrl.te_quant.linears import (
    AlignedColumnParallelLinear,
    AlignedRowParallelLinear,
    AlignedSequentialMLP,
)
from megatron_qrl.te_quant.shard_quant import FusionLayout
from megatron_qrl.te_quant.state import AlignedForwardState

SpecHook = Callable[[Any, Any], Any]


def _linear(cls: type, state: AlignedForwardState, kind: str, layout: FusionLayout) -> Any:
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=cls, params={"qrl_state": state, "qrl_kind": kind,
                                          "qrl_layout": layout})


def _aligned(module: Any, default: type) -> type:
    """The aligned class replacing ``module``: TE's name-keeping stand-in for a TE linear.

    Matched by identity with megatron's wrapper (without TE those are placeholders, not
    classes) or by class name."""
    from megatron.core.extensions import transformer_engine as te_ext

    from megatron_qrl.te_quant.te_names import TE_LINEAR_SWAPS

    for name, aligned in TE_LINEAR_SWAPS.items():
        if module is getattr(te_ext, name, None) or getattr(module, "__name__", None) == name:
            return aligned
    return default


def _swap_mlp(mlp_sub: Any, state: AlignedForwardState, kind: str) -> None:
    fc1 = _aligned(mlp_sub.linear_fc1, AlignedColumnParallelLinear)
    fc2 = _aligned(mlp_sub.linear_fc2, AlignedRowParallelLinear)
    mlp_sub.linear_fc1 = _linear(fc1, state, kind, FusionLayout("gate_up"))
    mlp_sub.linear_fc2 = _linear(fc2, state, kind, FusionLayout())


def _swap_experts(moe_sub: Any, state: AlignedForwardState, config: Any) -> None:
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_qrl.models.stacked_experts import StackedGroupedMLP
    from megatron_qrl.te_quant import te_grouped

    experts = moe_sub.experts
    grouped = {  # TE's grouped GEMM experts (weight{i} names) and the stacked ones
        TEGroupedMLP: (te_grouped.AlignedTEGroupedMLP, te_grouped.AlignedTEColumnParallelGroupedLinear,
                       te_grouped.AlignedTERowParallelGroupedLinear),
        StackedGroupedMLP: (te_grouped.AlignedStackedGroupedMLP,
                            te_grouped.AlignedStackedColumnGroupedLinear,
                            te_grouped.AlignedStackedRowGroupedLinear)}
    if experts.module in grouped:
        mlp, fc1, fc2 = grouped[experts.module]
        sub = MLPSubmodules(
            activation_func=getattr(experts.submodules, "activation_func", None),
            linear_fc1=_linear(fc1, state, "experts", FusionLayout("gate_up")),
            linear_fc2=_linear(fc2, state, "experts", FusionLayout()))
        moe_sub.experts = ModuleSpec(module=mlp, params={"qrl_state": state}, submodules=sub)
        return
    if experts.module is not SequentialMLP or not isinstance(experts.submodules, MLPSubmodules):
        raise ValueError(f"--qrl-train-forward aligned: experts {experts.module.__name__} are not "
                         "supported; use TEGroupedMLP (--moe-grouped-gemm on the Transformer "
                         "Engine spec) or SequentialMLP (no --moe-use-legacy-grouped-gemm)")
    if getattr(config, "moe_grouped_gemm", False):
        raise ValueError("--moe-grouped-gemm: the layer spec holds SequentialMLP experts (one GEMM "
                         "per expert); the aligned grouped path needs TEGroupedMLP (the "
                         "Transformer Engine spec, --transformer-impl transformer_engine); drop "
                         "--moe-grouped-gemm for the sequential path")
    sub = experts.submodules
    _swap_mlp(sub, state, "experts")
    moe_sub.experts = ModuleSpec(module=AlignedSequentialMLP, params={"qrl_state": state},
                                 submodules=sub)


def aligned_spec_hook(state: AlignedForwardState) -> SpecHook:
    """A ``spec_hook(layer_spec, config) -> layer_spec`` for ``models.builder``.

    Every swapped linear reads ``state`` at forward time (format, enabled layer kinds, weight
    version); call ``state.attach_to_optimizer(optimizer)`` once the optimizer exists.
    """
    if not isinstance(state, AlignedForwardState):
        raise TypeError(f"aligned_spec_hook needs an AlignedForwardState, got {type(state).__name__}")

    def hook(layer_spec: Any, config: Any) -> Any:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        spec = copy_spec(layer_spec)
        sub = spec.submodules
        attn = sub.self_attention.submodules
        qkv = FusionLayout("qkv", config.num_attention_heads // config.num_query_groups,
                           config.kv_channels)
        attn.linear_qkv = _linear(_aligned(attn.linear_qkv, AlignedColumnParallelLinear), state,
                                  "attention", qkv)
        attn.linear_proj = _linear(_aligned(attn.linear_proj, AlignedRowParallelLinear), state,
                                   "attention", FusionLayout())
        if sub.mlp.module is MoELayer:
            _swap_experts(sub.mlp.submodules, state, config)
        else:
            _swap_mlp(sub.mlp.submodules, state, "mlp")
        return spec

    return hook


def compose_hooks(*hooks: SpecHook | None) -> SpecHook | None:
    """Apply several spec hooks left to right (None entries are skipped)."""
    live = [h for h in hooks if h is not None]
    if not live:
        return None

    def hook(layer_spec: Any, config: Any) -> Any:
        for h in live:
            layer_spec = h(layer_spec, config)
        return layer_spec

    return hook
