"""Megatron's Transformer Engine layer spec, built on a CPU without TE (test support, no tests).

``megatron.core.models.gpt.gpt_layer_specs`` builds the TE spec through ``TESpecProvider``
(``extensions/transformer_engine_spec_provider.py``), which it only imports where TE does.
:func:`te_spec_on_cpu` hands megatron's own spec functions a provider that returns the same
classes in the same places — megatron's TE linear wrappers (``TELayerNormColumnParallelLinear``,
``TEColumnParallelLinear``, ``TERowParallelLinear``; defined, though not buildable, without
TE), ``TEGroupedMLP`` for grouped experts — and, for the modules the aligned swap leaves alone
(the norms, the core attention), CPU torch modules with TE's parameter names (``TENorm`` is a
``te.pytorch.RMSNorm``: ``weight``). So the spec tree is megatron's, and what the swap builds
from it is what it builds from the real TE spec on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

TE_LINEAR_NAMES = ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear",
                   "TERowParallelLinear")


def cpu_te_provider() -> type:
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.backends import BackendSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    from megatron_qrl.models.builder import SequenceParallelRMSNorm
    from megatron_qrl.models.sdpa_attention import SDPACoreAttention

    class CpuTESpecProvider(BackendSpecProvider):
        """``TESpecProvider`` of megatron-core 0.16.1 with CPU norms / core attention.

        Megatron-LM 1dcf0da's (0.16.0rc0, slime 0.3.1's pin) spec functions construct it as
        ``TESpecProvider(fallback_to_eager_attn=...)``; the CPU core attention is eager already.
        """

        def __init__(self, fallback_to_eager_attn: bool = False) -> None:
            self.fallback_to_eager_attn = fallback_to_eager_attn

        def linear(self) -> type:
            return te_ext.TELinear

        def column_parallel_linear(self) -> type:
            return te_ext.TEColumnParallelLinear

        def row_parallel_linear(self) -> type:
            return te_ext.TERowParallelLinear

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return te_ext.TELayerNormColumnParallelLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
            return SequenceParallelRMSNorm

        def core_attention(self) -> type:
            return SDPACoreAttention

        def grouped_mlp_modules(self, moe_use_grouped_gemm: bool,
                                moe_use_legacy_grouped_gemm: bool):
            if moe_use_grouped_gemm:  # TE{Column,Row}ParallelGroupedLinear: None without TE
                return TEGroupedMLP, MLPSubmodules(
                    linear_fc1=te_ext.TEColumnParallelGroupedLinear,
                    linear_fc2=te_ext.TERowParallelGroupedLinear)
            return SequentialMLP, MLPSubmodules(linear_fc1=te_ext.TEColumnParallelLinear,
                                                linear_fc2=te_ext.TERowParallelLinear)

        def activation_func(self) -> None:
            return None

    return CpuTESpecProvider


@contextlib.contextmanager
def te_spec_on_cpu() -> Iterator[None]:
    """Inside: ``get_gpt_layer_with_transformer_engine_spec`` / ``get_gpt_decoder_block_spec``
    (``use_transformer_engine=True``) and ``models.builder.layer_spec(use_te=True)`` build
    megatron's TE spec tree with the CPU provider and norm above."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from megatron_qrl.models.builder import SequenceParallelRMSNorm

    saved = [(mod, name, getattr(mod, name, None), hasattr(mod, name))
             for mod, name in ((specs, "TESpecProvider"), (specs, "TENorm"), (te_ext, "TENorm"))]
    specs.TESpecProvider = cpu_te_provider()
    specs.TENorm = te_ext.TENorm = SequenceParallelRMSNorm
    try:
        yield
    finally:
        for mod, name, value, had in saved:
            if had:
                setattr(mod, name, value)
            else:
                delattr(mod, name)


def build_te_shaped(arch, spec_hook=None, **overrides):
    """A GPTModel of ``arch`` from the TE spec on CPU (allgather dispatcher: megatron's
    alltoall one needs CUDA streams), ``spec_hook`` applied as ``models.builder`` does."""
    from megatron_qrl.models.runtime import build_model

    kw = dict(use_cpu_initialization=True)
    if arch.is_moe:
        kw["moe_token_dispatcher_type"] = "allgather"
    kw.update(overrides)
    with te_spec_on_cpu():
        return build_model(arch, spec_hook=spec_hook, use_te=True, **kw)
