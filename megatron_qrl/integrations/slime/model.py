"""The rollout-aligned forward on slime's Megatron model, through Megatron's ``--spec``.

``--spec megatron_qrl.integrations.slime.model qrl_layer_spec``: slime's model provider calls
``qrl_layer_spec(args, config, vp_stage)`` for the transformer layer spec (its documented use
of ``--spec``). It returns the spec slime builds without ``--spec`` — Megatron's decoder block
spec for MoE models, the TE / local layer spec for dense ones, same arguments — passed through
the project's layer-spec swap (:func:`megatron_qrl.te_quant.aligned_spec_hook`) when
``--qrl-train-forward aligned``, and untouched otherwise. No Megatron or slime class is
patched: on the Transformer Engine spec (slime's default) the swapped modules are the
name-keeping aligned stand-ins of :mod:`megatron_qrl.te_quant.te_names` /
:mod:`~megatron_qrl.te_quant.te_grouped` — same parameter names
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.experts.linear_fc1.weight{i}``, ...),
shapes, tensor-parallel attributes, ``_extra_state`` and sharded state dict as TE's
modules — so slime's weight converters (``megatron_to_hf/qwen3moe.py``, ``qwen2.py``), its
all-gather of TP shards and its torch_dist checkpoints work unchanged; on the local spec they
are ``ColumnParallelLinear`` / ``RowParallelLinear`` subclasses (local names, as slime's
plain local model has). One :class:`~megatron_qrl.te_quant.AlignedForwardState` per model
chunk, found again by :func:`aligned_states` (the hooks drive it).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from megatron_qrl.integrations.slime.options import slime_options
from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook
from megatron_qrl.te_quant.spec_hook import SpecHook


def slime_default_spec(args: Any, config: Any, vp_stage: int | None = None) -> Any:
    """The layer spec slime 0.3.1's model provider builds when ``--spec`` is not given."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        kwargs = {"use_transformer_engine": use_te}
        if vp_stage is not None:
            kwargs["vp_stage"] = vp_stage
        return specs.get_gpt_decoder_block_spec(config, **kwargs)
    build = (specs.get_gpt_layer_with_transformer_engine_spec if use_te
             else specs.get_gpt_layer_local_spec)
    return build(num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm,
                 qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention,
                 moe_use_legacy_grouped_gemm=args.moe_use_legacy_grouped_gemm)


def apply_spec_hook(spec: Any, hook: SpecHook | None, config: Any) -> Any:
    """``hook`` on a layer spec, or on every layer of a decoder block spec."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if hook is None:
        return spec
    if isinstance(spec, TransformerBlockSubmodules):
        block = copy.copy(spec)
        block.layer_specs = [hook(layer, config) for layer in spec.layer_specs]
        return block
    return hook(spec, config)


def qrl_spec_hook(args: Any) -> SpecHook | None:
    """The qrl layer-spec swap of this run (None: the model stays slime's)."""
    opts = slime_options(args)
    if opts.train.forward != "aligned":
        return None
    return aligned_spec_hook(AlignedForwardState(opts.rollout.format))


def qrl_layer_spec(args: Any, config: Any, vp_stage: int | None = None) -> Any:
    """Megatron ``--spec`` entry point slime's model provider calls (see the module doc)."""
    return apply_spec_hook(slime_default_spec(args, config, vp_stage), qrl_spec_hook(args), config)


def aligned_states(model: Any) -> list[AlignedForwardState]:
    """The aligned-forward states of a model (a module or slime's list of model chunks)."""
    chunks: Iterable[Any] = model if isinstance(model, (list, tuple)) else [model]
    found: dict[int, AlignedForwardState] = {}
    for chunk in chunks:
        for module in chunk.modules():
            state = getattr(module, "qrl_state", None)
            if isinstance(state, AlignedForwardState):
                found.setdefault(id(state), state)
    return list(found.values())
