"""Build a megatron-core ``GPTModel`` for a Qwen3 / Qwen3-MoE :class:`ModelArch`.

:func:`config_and_spec` is the one place the ``TransformerConfig`` and the layer
``ModuleSpec`` are made; callers that swap linear layers (the rollout-aligned forward) pass
``spec_hook``, a function ``(ModuleSpec, TransformerConfig) -> ModuleSpec`` applied last.

Which layer implementation (Megatron-LM's ``--transformer-impl``): :data:`TRANSFORMER_IMPLS`,
resolved by :func:`resolve_transformer_impl`. ``transformer_engine`` is Megatron's TE spec (TE
linears with the pre-norm fused in, ``TEDotProductAttention`` / flash attention,
``TEGroupedMLP`` experts with ``moe_grouped_gemm``); ``local`` is the pure-torch spec with
core attention through ``scaled_dot_product_attention`` (:mod:`.sdpa_attention`; never the
materialised softmax); ``auto`` (the default) picks TE where it imports and a GPU is present,
as Megatron-LM defaults to TE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.utils.optional import available

SpecHook = Callable[[Any, Any], Any]
TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor / pipeline / expert parallel sizes the model is built for."""

    tp: int = 1
    """Tensor-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE only); must divide the number of experts."""
    etp: int = 1
    """Expert tensor-parallel size; 1 keeps every expert whole on its rank."""
    sequence_parallel: bool | None = None
    """Sequence parallelism; None turns it on when tp > 1 (MoE with TP > 1 needs it to train)."""
    pp: int = 1
    """Pipeline-parallel size: each stage builds ``num_layers / pp`` consecutive decoder
    layers (the first the embedding, the last the final norm and output layer)."""

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "etp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelLayout.{name} must be >= 1, got {getattr(self, name)}")

    def check(self, arch: ModelArch) -> None:
        """Raise a ValueError naming the size that does not divide ``arch``'s dimensions."""
        if arch.num_kv_heads % self.tp:
            raise ValueError(f"tp={self.tp} must divide num_key_value_heads={arch.num_kv_heads}")
        if arch.vocab_size % self.tp:
            raise ValueError(f"tp={self.tp} must divide vocab_size={arch.vocab_size}")
        if self.ep > 1 and (not arch.is_moe or arch.num_experts % self.ep):
            raise ValueError(f"ep={self.ep} must divide num_experts={arch.num_experts} (MoE only)")
        if arch.num_layers % self.pp:
            raise ValueError(f"pp={self.pp} must divide num_hidden_layers={arch.num_layers}")


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with Megatron's norm constructor; marks its gain ``.sequence_parallel``.

    Megatron's ``WrappedTorchNorm`` (local spec) asserts ``not config.sequence_parallel``;
    with SP the gain's gradient must be all-reduced over TP, which Megatron's DDP/finalize
    step does for parameters carrying ``sequence_parallel=True``.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        on_gpu = torch.cuda.is_available() and not config.use_cpu_initialization
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype,
                         device=torch.cuda.current_device() if on_gpu else None)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def use_transformer_engine() -> bool:
    """True when Transformer Engine imports here (the TE spec is then used by default)."""
    return available("transformer_engine.pytorch")[0]


def resolve_transformer_impl(impl: str | bool | None = "auto") -> bool:
    """True for the TE spec. ``impl``: one of :data:`TRANSFORMER_IMPLS` (None = ``auto``: TE
    where it imports and CUDA is present) or a bool (True = TE). Raises naming the flag when
    ``transformer_engine`` is asked for and TE does not import."""
    if isinstance(impl, bool):
        return impl
    impl = impl or "auto"
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"--transformer-impl {impl!r}: choose one of {TRANSFORMER_IMPLS}")
    if impl == "local":
        return False
    te = use_transformer_engine()
    if impl == "transformer_engine" and not te:
        raise ValueError("--transformer-impl transformer_engine: Transformer Engine does not "
                         f"import here ({available('transformer_engine.pytorch')[1]}); install it "
                         "or use --transformer-impl local")
    return te and (impl == "transformer_engine" or torch.cuda.is_available())


def transformer_config(arch: ModelArch, layout: ParallelLayout | None = None,
                       params_dtype: torch.dtype = torch.float32, use_te: bool | None = None,
                       **overrides: Any) -> Any:
    """The megatron-core ``TransformerConfig`` of ``arch`` at ``layout``; ``overrides`` win.

    ``use_te`` (default: TE importable): the TE spec will be built, so the alltoall dispatcher
    may be used and, on a GPU, RoPE is TE's fused kernel; without TE the MoE dispatcher is
    allgather (below)."""
    from megatron.core.transformer import TransformerConfig

    layout = layout or ParallelLayout()
    layout.check(arch)
    sp = layout.tp > 1 if layout.sequence_parallel is None else layout.sequence_parallel
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp, sequence_parallel=sp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16, pipeline_dtype=params_dtype,
        bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_top_k,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            # softmax over top-k logits == renormalised top-k of the full softmax
            moe_router_pre_softmax=not arch.norm_topk_prob, moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=arch.router_aux_loss_coef,
            moe_grouped_gemm=False,
        )
    if arch.is_moe:
        kwargs.update(moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall")
    te = use_transformer_engine() if use_te is None else use_te
    # TE's fused RoPE kernel (Megatron-LM's default, ``--no-rope-fusion`` turns it off): the
    # unfused rotation is ~5 elementwise passes over q and k per layer, forward and backward
    kwargs["apply_rope_fusion"] = bool(te and torch.cuda.is_available())
    if not te:
        # megatron-core 0.16.1 without TE: the alltoall dispatcher builds a torch.cuda.Stream
        # in __init__, so the CPU build uses the allgather dispatcher (same maths, dropless).
        # Parameters are created on the GPU when there is one (megatron's default).
        if not torch.cuda.is_available():
            # (batch_p2p_sync: the pipeline schedule's torch.cuda.synchronize after its
            # batched sends; on CPU/gloo the requests' wait() is the whole synchronisation)
            kwargs.update(use_cpu_initialization=True, batch_p2p_sync=False)
        if arch.is_moe:
            kwargs.update(moe_token_dispatcher_type="allgather")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(arch: ModelArch, config: Any, use_te: bool | str | None = None,
               spec_hook: SpecHook | None = None) -> Any:
    """The decoder block spec: TE spec if ``use_te`` (a bool or a :data:`TRANSFORMER_IMPLS`
    name; default ``auto``), else local with SDPA core attention.

    ``spec_hook`` maps the decoder LAYER ``ModuleSpec`` (before it is repeated over layers).
    The local spec gets :class:`SequenceParallelRMSNorm` for every norm, the final one too.
    Grouped-GEMM experts follow ``config.moe_grouped_gemm``: TEGroupedMLP on the TE spec; on the
    local spec only a ``spec_hook`` that replaces the sequential experts (the stacked experts of
    :mod:`.stacked_experts`) may ask for it. Under pipeline
    parallelism the block holds this stage's layers only (megatron-core's
    ``get_num_layers_to_build``, as its ``get_gpt_decoder_block_spec``).
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_qrl.models.sdpa_attention import SDPACoreAttention

    use_te = resolve_transformer_impl(use_te)
    num_experts = arch.num_experts if arch.is_moe else None
    grouped = bool(arch.is_moe and config.moe_grouped_gemm)
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=grouped, qk_layernorm=True)
        from megatron.core.extensions.transformer_engine import TENorm
        final_norm: Any = TENorm
    else:
        spec = specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True,
            normalization="RMSNorm")
        sub = spec.submodules
        sub.input_layernorm = SequenceParallelRMSNorm
        sub.pre_mlp_layernorm = SequenceParallelRMSNorm
        sub.self_attention.submodules.q_layernorm = SequenceParallelRMSNorm
        sub.self_attention.submodules.k_layernorm = SequenceParallelRMSNorm
        sub.self_attention.submodules.core_attention = SDPACoreAttention
        final_norm = SequenceParallelRMSNorm
    if spec_hook is not None:
        spec = spec_hook(spec, config)
    if grouped and _sequential_experts(spec):
        raise ValueError("--moe-grouped-gemm needs the Transformer Engine spec "
                         "(--transformer-impl transformer_engine) or --qrl-train-moe-experts "
                         "stacked")
    num_layers = config.num_layers
    if config.pipeline_model_parallel_size > 1:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build

        num_layers = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=final_norm)


def _sequential_experts(layer_spec: Any) -> bool:
    """The layer's MoE experts are megatron-core's ``SequentialMLP`` (one GEMM per expert)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = getattr(getattr(layer_spec.submodules.mlp, "submodules", None), "experts", None)
    return getattr(experts, "module", None) is SequentialMLP


def config_and_spec(arch: ModelArch, layout: ParallelLayout | None = None,
                    params_dtype: torch.dtype = torch.float32, use_te: bool | str | None = None,
                    spec_hook: SpecHook | None = None, **overrides: Any) -> tuple[Any, Any]:
    """``(TransformerConfig, decoder block spec)`` of ``arch``; see the module docstring."""
    te = resolve_transformer_impl(use_te)
    config = transformer_config(arch, layout, params_dtype, use_te=te, **overrides)
    return config, layer_spec(arch, config, te, spec_hook)


def build_gpt_model(arch: ModelArch, config: Any, spec: Any, pg_collection: Any = None,
                    pre_process: bool = True, post_process: bool = True) -> Any:
    """A megatron-core ``GPTModel`` of ``arch`` (RoPE, untied or tied output layer), on the GPU
    when there is one and the config does not ask for CPU initialization — as Megatron-LM's
    ``get_model`` does with ``model.cuda()``: megatron-core 0.16.1's MoE ``TopKRouter`` creates its
    weight on the CPU and moves it only at its first forward, after the optimizer has wrapped it
    (the H200 run of bench/rl_step.py on the Qwen3-30B-A3B shape failed on it)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=arch.rope_theta,
        pg_collection=pg_collection,
    )
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        model.cuda(torch.cuda.current_device())
    return model
