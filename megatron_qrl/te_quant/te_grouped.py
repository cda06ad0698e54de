"""Rollout-aligned stand-ins for ``TEGroupedMLP``'s grouped linears that KEEP TE's names.

Megatron's TE spec with ``--moe-grouped-gemm`` builds ``TEGroupedMLP`` whose ``linear_fc1`` /
``linear_fc2`` are ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``: one
parameter per local expert, ``weight0 .. weight{n-1}`` (slime's converters match
``mlp.experts.linear_fc1.weight(\\d+)``), one ``_extra_state``, and a sharded state dict that
maps each expert to its global index (interchangeable with ``SequentialMLP``'s, Megatron
``TEGroupedMLP.sharded_state_dict``). The classes here hold exactly those names, shapes and
attributes (TE 2.x ``GroupedLinear.set_tensor_parallel_attributes``, Megatron's
``TEGroupedLinear``), and compute all experts' GEMMs as one grouped GEMM
(:mod:`megatron_qrl.te_quant.grouped_gemm`) with the rollout's quantized weights (QaRL's
aligned forward, Fan et al. 2025; straight-through gradient, Bengio et al. 2013):
``y_e = Q_a(x_e) @ Q_w(W_e)^T``. ``Q_w`` of all local experts is cached stacked
``[experts, out, in]`` once per optimizer step; ``Q_a`` is one call over all permuted tokens. Like TE's grouped linear they never communicate: Megatron's
token dispatcher moves tokens across expert-TP / EP ranks.

:class:`AlignedTEGroupedMLP` is ``TEGroupedMLP`` with the gate applied after ``linear_fc2``
when activations are quantized (SGLang's fused-MoE order, see
:class:`~megatron_qrl.te_quant.linears.AlignedSequentialMLP`).

The same aligned GEMM (:class:`AlignedGroupedGemm`) serves the stacked experts of
:mod:`megatron_qrl.models.stacked_experts` (``--qrl-train-moe-experts stacked``):
:class:`AlignedStackedGroupedLinear` keeps their ONE ``[experts, out, in]`` weight, and the
straight-through gradient goes into that stack whole.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import TEGroupedMLP

from megatron_qrl.models.grouped_gemm import grouped_mm
from megatron_qrl.models.stacked_experts import (
    StackedGroupedLinear,
    StackedGroupedMLP,
    expert_groups,
    grouped_sharded_state_dict,
)
from megatron_qrl.quant import QuantizedWeight
from megatron_qrl.te_quant.grouped_gemm import stacked_ste
from megatron_qrl.te_quant.linears import (
    _PLAIN,
    _UseQuantized,
    gate_output,
    qrl_label,
    quantize_input,
)
from megatron_qrl.te_quant.qcodes import component_codes, fused_dequantized, real_codes
from megatron_qrl.te_quant.real_gemm import RealWeight, grouped_real_linear, stacked_weight_operand
from megatron_qrl.te_quant.shard_quant import (
    FusionLayout,
    fake_quant_stack_in_place,
    quantize_shard,
    quantize_shards_stacked,
)
from megatron_qrl.te_quant.state import AlignedForwardState
from megatron_qrl.te_quant.te_names import TEExtraState, set_te_parallel_attributes


def _pg_size_rank(group: Any) -> tuple[int, int]:
    from megatron.core.utils import get_pg_rank, get_pg_size

    return get_pg_size(group), get_pg_rank(group)


class AlignedGroupedGemm:
    """The aligned grouped GEMM of a module holding all local experts' weights of one linear
    (per-expert parameters or one stacked parameter): ``Q_w`` of every expert cached stacked
    once per optimizer step, ``Q_a`` in one call, one grouped GEMM."""

    parallel_mode = "column"
    qrl_state: AlignedForwardState
    qrl_kind: str
    qrl_layout: FusionLayout

    def _init_aligned(self, qrl_state: AlignedForwardState, qrl_kind: str,
                      qrl_layout: FusionLayout) -> None:
        if not isinstance(qrl_state, AlignedForwardState):
            raise TypeError(f"qrl_state must be an AlignedForwardState, got {type(qrl_state).__name__}")
        self.qrl_state, self.qrl_kind, self.qrl_layout = qrl_state, qrl_kind, qrl_layout
        self.qrl_recomputes = 0
        self._qrl_cache: tuple[Any, torch.Tensor] | None = None
        self._qrl_codes: list[list[QuantizedWeight]] | None = None

    def weights(self) -> list[torch.Tensor]:
        """Every local expert's master weight ``[out, in]``, in expert order."""
        raise NotImplementedError

    def _masters(self, quantized: torch.Tensor | None) -> torch.Tensor:
        """The stacked masters (``quantized`` None) or ``quantized`` with the straight-through
        gradient into them."""
        raise NotImplementedError

    def _real_masters(self) -> list[torch.Tensor]:
        """The parameters the real path's straight-through gradient goes into."""
        return self.weights()

    def _stack(self) -> list[torch.Tensor] | torch.Tensor:
        """The masters as the real path's quantizer reads them: one weight per expert, or the
        stacked ``[E, out, in]`` parameter where the module holds one."""
        return self.weights()

    def _qrl_key(self) -> tuple:
        return (self.qrl_state.version, *((w._version, w.data_ptr()) for w in self.weights()))

    def quantized_weights(self) -> torch.Tensor:
        """``Q_w(W_e)`` of every local expert's shard stacked ``[num_gemms, out, in]``,
        recomputed only after the weights changed (once per optimizer step): one stacked
        quantizer call where the stack is bit-identical, else one call per expert. The
        finiteness goes to the state's refresh checks (:meth:`~.state.AlignedForwardState.
        check_finite`)."""
        key = self._qrl_key()
        if self._qrl_cache is None or self._qrl_cache[0] != key:
            spec, weights = self.qrl_state.spec, self.weights()
            name, finite = qrl_label(self), self.qrl_state.finite_checks()
            tp, _ = _pg_size_rank(self.tp_group)
            if tp == 1 and self.qrl_state.keep_codes:
                codes = component_codes(spec, weights, self.qrl_layout, name, finite)
                deq = [fused_dequantized(spec, c, self.qrl_layout) for c in codes]
                self._qrl_cache, self._qrl_codes = (key, torch.stack(deq)), codes
                self.qrl_recomputes += 1
                return self._qrl_cache[1]
            names = [f"{name}[{e}]" for e in range(len(weights))]  # expert e
            qs = (quantize_shards_stacked(spec, weights, [self.qrl_layout] * len(weights), name,
                                          finite, names) if tp == 1 and len(weights) > 1
                  else None)
            if qs is None:
                dim = 1 if self.parallel_mode == "row" else 0
                qs = [quantize_shard(spec, w, self.qrl_layout, dim, self.tp_group, n, finite)
                      for n, w in zip(names, weights)]
            self._qrl_cache, self._qrl_codes = (key, torch.stack(qs)), None
            self.qrl_recomputes += 1
        return self._qrl_cache[1]

    def real_weights(self) -> RealWeight:
        """Codes and per-channel scales of every local expert, stacked ``[E, N, K]`` /
        ``[E, N, 1]`` (the real GEMM's operands), cached like :meth:`quantized_weights`."""
        key = self._qrl_key()
        if self._qrl_cache is None or self._qrl_cache[0] != key:
            dim = 1 if self.parallel_mode == "row" else 0
            rw = stacked_weight_operand(self.qrl_state.spec, self._stack(), dim, self.tp_group,
                                        qrl_label(self), self.qrl_state.finite_checks())
            self._qrl_cache = (key, replace(rw, keep_dequantized=self.qrl_state.keep_dequantized))
            self.qrl_recomputes += 1
        return self._qrl_cache[1]

    def qrl_codes(self) -> list[list[QuantizedWeight]] | None:
        """Per local expert, the codes and scales of each of its HF tensors from the cached
        ``Q_w`` (refreshed first if stale: the step's one quantization); None where the
        experts are tensor-parallel shards (the sync sends whole tensors)."""
        if _pg_size_rank(self.tp_group)[0] > 1:
            return None
        state, layout = self.qrl_state, self.qrl_layout
        if state.gemm_for(self.qrl_kind) == "real":
            rw, dtype = self.real_weights(), self.weights()[0].dtype
            return [real_codes(state.spec, RealWeight(c, s), layout, dtype)
                    for c, s in zip(rw.codes.unbind(0), rw.scale.unbind(0))]
        if state.keep_codes and self._qrl_codes is None:
            self._qrl_cache = None  # cached before codes were kept
        self.quantized_weights()
        return self._qrl_codes

    def forward(self, x: torch.Tensor, m_splits: Any) -> tuple[torch.Tensor, None]:
        """``cat_e(x_e @ W_e^T)`` over the experts' token groups ``m_splits`` as ONE grouped GEMM
        (:func:`~megatron_qrl.models.grouped_gemm.grouped_mm`); aligned: the stacked cached
        ``Q_w(W)`` and ``Q_a`` of all rows in one call (per-token scales: equal per expert)."""
        if (self.qrl_state.is_enabled(self.qrl_kind)
                and self.qrl_state.gemm_for(self.qrl_kind) == "real"):
            return grouped_real_linear(x, self._real_masters(), self.real_weights(),
                                       self.qrl_state.spec, m_splits,
                                       1 if self.parallel_mode == "row" else 0,
                                       self.tp_group, self.qrl_state.grad_fp8(),
                                       self.qrl_state.wgrad_fp8()), None
        if self.qrl_state.is_enabled(self.qrl_kind):
            stacked = self._masters(self.quantized_weights())
            x = quantize_input(self.qrl_state, x, 1 if self.parallel_mode == "row" else 0,
                               self.tp_group)
        else:
            stacked = self._masters(None)
        return grouped_mm(x, stacked, m_splits), None


class AlignedTEGroupedLinear(TEExtraState, AlignedGroupedGemm, MegatronModule):
    """Megatron's ``TEGroupedLinear`` names (``weight{i}``), one grouped GEMM (aligned or plain)."""

    parallel_mode = "column"
    """``column`` (output features split over expert TP) or ``row`` (input features)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any,
                 init_method: Any, bias: bool, skip_bias_add: bool, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, pg_collection: Any = None,
                 qrl_state: AlignedForwardState, qrl_kind: str = "experts",
                 qrl_layout: FusionLayout = _PLAIN) -> None:
        super().__init__(config=config)
        if not is_expert:
            raise ValueError("TEGroupedLinear only supports expert parallelism (is_expert=True)")
        if bias:
            raise ValueError("aligned grouped experts support add_bias_linear=False (Qwen3-MoE); "
                             "use --moe-grouped-gemm off for biased experts")
        self._pg_collection, self.tp_group, tp, self.expert_parallel = expert_groups(
            config, pg_collection)
        self._tp_group = self.tp_group
        self.explicit_expert_comm = tp > 1 or self.expert_parallel
        self.num_gemms = num_gemms
        self.in_features = input_size // tp if self.parallel_mode == "row" else input_size
        self.out_features = output_size // tp if self.parallel_mode == "column" else output_size
        self.use_bias = False
        self._init_aligned(qrl_state, qrl_kind, qrl_layout)
        # TE's mode is None with explicit expert communication: partition_dim 0 even for "row"
        dim = 1 if self.parallel_mode == "row" and not self.explicit_expert_comm else 0
        for i in range(num_gemms):
            weight = torch.nn.Parameter(self._new_weight(config, init_method))
            set_te_parallel_attributes(weight, dim)
            weight.allreduce = not self.expert_parallel
            self.register_parameter(f"weight{i}", weight)
        self._register_load_state_dict_pre_hook(self._drop_split_extra_states)

    def _new_weight(self, config: Any, init_method: Any) -> torch.Tensor:
        """Allocated where TE's wrapper allocates (``_get_extra_te_kwargs``), initialised by
        ``init_method`` under the expert-parallel RNG tracker as TE does."""
        cuda = torch.cuda.is_available() and not config.use_cpu_initialization
        meta = config.init_model_with_meta_device and not config.use_cpu_initialization
        device = "meta" if meta else (torch.cuda.current_device() if cuda else "cpu")
        w = torch.empty(self.out_features, self.in_features, dtype=config.params_dtype,
                        device=device)
        if config.perform_initialization and not meta:
            if cuda:
                from megatron.core.tensor_parallel.random import (
                    get_cuda_rng_tracker,
                    get_expert_parallel_rng_tracker_name,
                )

                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    init_method(w)
            else:
                init_method(w)
        return w

    def _drop_split_extra_states(self, state_dict: dict, prefix: str, *args: Any) -> None:
        """TE's dist-ckpt writes ``_extra_state1 ..`` per expert; the module loads one."""
        for i in range(1, self.num_gemms):
            state_dict.pop(f"{prefix}_extra_state{i}", None)

    def set_extra_state(self, state: Any) -> None:
        """TE's per-expert FP8 metadata is not kept (it would need TE's merge / split of the
        grouped state); the aligned forward runs no TE FP8 recipe. Saved again as empty."""
        self._qrl_te_extra = None

    def backward_dw(self) -> None:
        """Weight gradients come from autograd at backward time (nothing deferred)."""

    def weights(self) -> list[torch.Tensor]:
        """``[weight0, .., weight{n-1}]``."""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _masters(self, quantized: torch.Tensor | None) -> torch.Tensor:
        weights = self.weights()
        return torch.stack(weights) if quantized is None else stacked_ste(quantized, weights)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Each local expert's weight as its global expert's shard (TE's
        ``TEGroupedLinear._sharded_state_dict_grouped``, Megatron 0.16)."""
        return grouped_sharded_state_dict(self.weights(), self.get_extra_state(), prefix,
                                          sharded_offsets, metadata, self.parallel_mode == "row",
                                          self._pg_collection, self._tp_group)


class AlignedTEColumnParallelGroupedLinear(AlignedTEGroupedLinear):
    """``TEColumnParallelGroupedLinear`` (experts' ``linear_fc1``), aligned."""

    parallel_mode = "column"


class AlignedTERowParallelGroupedLinear(AlignedTEGroupedLinear):
    """``TERowParallelGroupedLinear`` (experts' ``linear_fc2``), aligned."""

    parallel_mode = "row"


class AlignedTEGroupedMLP(TEGroupedMLP):
    """``TEGroupedMLP`` whose gate weights each expert's OUTPUT when activations are quantized.

    megatron-core multiplies the gate into the GLU output before ``linear_fc2``
    (``fc2(Q_a(p * h))``); SGLang's fused MoE after the down GEMM (``p * fc2(Q_a(h))``): the
    forward agrees up to rounding (per-token scales), the gate's straight-through gradient
    does not; this order is the rollout's. Otherwise upstream's forward runs unchanged.
    """

    def __init__(self, *args: Any, qrl_state: AlignedForwardState, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qrl_state = qrl_state

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, Any]:
        state = self.qrl_state
        if not (state.is_enabled("experts") and state.spec.quantizes_activations):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if self.config.add_bias_linear or self.config.moe_apply_probs_on_input:
            raise ValueError("aligned W8A8 experts support add_bias_linear=False and "
                             "moe_apply_probs_on_input=False (Qwen3-MoE)")
        out, bias = super().forward(permuted_local_hidden_states, tokens_per_expert,
                                    torch.ones_like(permuted_probs))
        return gate_output(out, permuted_probs), bias


class AlignedStackedGroupedLinear(AlignedGroupedGemm, StackedGroupedLinear):
    """:class:`~megatron_qrl.models.stacked_experts.StackedGroupedLinear` (one stacked
    ``weight``), aligned: the straight-through gradient goes into the stack as a whole."""

    def __init__(self, *args: Any, qrl_state: AlignedForwardState, qrl_kind: str = "experts",
                 qrl_layout: FusionLayout = _PLAIN, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_aligned(qrl_state, qrl_kind, qrl_layout)

    def weights(self) -> list[torch.Tensor]:
        return list(self.weight.unbind(0))

    def _qrl_key(self) -> tuple:
        return (self.qrl_state.version, self.weight._version, self.weight.data_ptr())

    def _real_masters(self) -> list[torch.Tensor]:
        return [self.weight]

    def _stack(self) -> torch.Tensor:
        return self.weight

    def quantized_weights(self) -> torch.Tensor:
        """:meth:`AlignedGroupedGemm.quantized_weights`, the stack's rows quantized where they
        lie where that is bit-identical (:func:`~.shard_quant.fake_quant_stack_in_place`: no
        copy of the stack per optimizer step)."""
        key = self._qrl_key()
        if ((self._qrl_cache is None or self._qrl_cache[0] != key)
                and not self.qrl_state.keep_codes and _pg_size_rank(self.tp_group)[0] == 1):
            q = fake_quant_stack_in_place(self.qrl_state.spec, self.weight, self.qrl_layout,
                                          qrl_label(self), self.qrl_state.finite_checks())
            if q is not None:
                self._qrl_cache, self._qrl_codes = (key, q), None
                self.qrl_recomputes += 1
        return super().quantized_weights()

    def _masters(self, quantized: torch.Tensor | None) -> torch.Tensor:
        return self.weight if quantized is None else _UseQuantized.apply(self.weight, quantized)


class AlignedStackedColumnGroupedLinear(AlignedStackedGroupedLinear):
    """The stacked experts' ``linear_fc1``, aligned."""

    parallel_mode = "column"


class AlignedStackedRowGroupedLinear(AlignedStackedGroupedLinear):
    """The stacked experts' ``linear_fc2``, aligned."""

    parallel_mode = "row"


class AlignedStackedGroupedMLP(AlignedTEGroupedMLP, StackedGroupedMLP):
    """:class:`AlignedTEGroupedMLP`'s gate order over the stacked experts."""
