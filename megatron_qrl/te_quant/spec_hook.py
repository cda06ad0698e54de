"""Swap the quantized linears of a decoder-layer ``ModuleSpec`` for rollout-aligned ones.

Megatron's mechanism for choosing layer implementations is the ``ModuleSpec``; the hook returned
by :func:`aligned_spec_hook` maps the layer spec built by ``models.builder`` (local or
Transformer Engine backend) to one whose attention ``linear_qkv`` / ``linear_proj``, dense MLP
``linear_fc1`` / ``linear_fc2`` and expert ``linear_fc1`` / ``linear_fc2`` are
:class:`~megatron_qrl.te_quant.linears.AlignedColumnParallelLinear` /
:class:`~megatron_qrl.te_quant.linears.AlignedRowParallelLinear`. The router, embeddings, norms
and the output layer are untouched (BF16, as in the rollout). No Megatron class is patched.

On the Transformer Engine spec the fused ``TELayerNormColumnParallelLinear`` is split back into
``TENorm`` + the aligned linear, and ``TEGroupedMLP`` experts become ``SequentialMLP`` (the same
parameter names modulo ``models.mapping.canonical_name``); TE FP8 recipes are a separate,
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


def _is_fused_norm_linear(module: Any) -> bool:
    return isinstance(module, type) and module.__name__ == "TELayerNormColumnParallelLinear"


def _unfuse_norm(layer_sub: Any, norm_attr: str, linear: Any) -> None:
    """TE fuses the pre-norm into the linear; give the norm back to the layer."""
    from megatron.core.transformer.identity_op import IdentityOp

    if _is_fused_norm_linear(linear) and getattr(layer_sub, norm_attr) is IdentityOp:
        from megatron.core.extensions.transformer_engine import TENorm

        setattr(layer_sub, norm_attr, TENorm)


def _swap_mlp(mlp_sub: Any, state: AlignedForwardState, kind: str) -> None:
    mlp_sub.linear_fc1 = _linear(AlignedColumnParallelLinear, state, kind, FusionLayout("gate_up"))
    mlp_sub.linear_fc2 = _linear(AlignedRowParallelLinear, state, kind, FusionLayout())


def _swap_experts(moe_sub: Any, state: AlignedForwardState) -> None:
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    experts = moe_sub.experts
    if experts.module is SequentialMLP and isinstance(experts.submodules, MLPSubmodules):
        sub = experts.submodules
    else:  # TE grouped experts: the same maths one expert at a time
        sub = MLPSubmodules(activation_func=getattr(experts.submodules, "activation_func", None))
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
        _unfuse_norm(sub, "input_layernorm", attn.linear_qkv)
        qkv = FusionLayout("qkv", config.num_attention_heads // config.num_query_groups,
                           config.kv_channels)
        attn.linear_qkv = _linear(AlignedColumnParallelLinear, state, "attention", qkv)
        attn.linear_proj = _linear(AlignedRowParallelLinear, state, "attention", FusionLayout())
        if sub.mlp.module is MoELayer:
            _swap_experts(sub.mlp.submodules, state)
        else:
            _unfuse_norm(sub, "pre_mlp_layernorm", sub.mlp.submodules.linear_fc1)
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
