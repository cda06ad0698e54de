"""Rollout-aligned linears: megatron-core's own parallel linears, computing with the rollout's weights.

QaRL (Fan et al. 2025, "rollout-aligned forward"): the trainer's forward must use exactly the
weights (and, for W8A8, the activation quantization) of the low-precision rollout, with a
straight-through gradient into the BF16 master weights (Bengio et al. 2013, STE):
``y = Q_a(x) @ Q_w(W)^T``, ``dL/dW := dL/dQ_w(W)``.

The classes subclass megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` and only
override ``_forward_impl`` (the local GEMM), so tensor/sequence parallelism, bias handling and
parameter names are upstream's. ``Q_w(W)`` is cached per linear and recomputed only when the
weights changed (see :mod:`megatron_qrl.te_quant.state`), never per micro-batch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_qrl.quant import QuantizedWeight
from megatron_qrl.te_quant.qcodes import component_codes, fused_dequantized, real_codes
from megatron_qrl.te_quant.real_gemm import RealWeight, real_linear, weight_operand
from megatron_qrl.te_quant.shard_quant import FusionLayout, quantize_shard, quantize_shards_stacked
from megatron_qrl.te_quant.state import AlignedForwardState

_PLAIN = FusionLayout()


class _UseQuantized(torch.autograd.Function):
    """Forward: the cached quantized weight; backward: identity into the master (STE)."""

    @staticmethod
    def forward(ctx, weight, quantized):  # noqa: D401
        return quantized.view_as(quantized)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GateOutput(torch.autograd.Function):
    """``(out * p).to(out.dtype)`` of a low-precision ``out`` and fp32 gates ``p`` ``[T, 1]``,
    forward and backward bit for bit as autograd computes that expression, without its fp32
    copies of ``out`` and of the incoming gradient: each product is computed in fp32 and
    rounded once into a tensor of ``out``'s dtype (``torch.mul(..., out=)``)."""

    @staticmethod
    def forward(ctx, out, p):  # noqa: D401
        ctx.save_for_backward(out, p)
        return torch.mul(out, p, out=torch.empty_like(out))

    @staticmethod
    def backward(ctx, grad):
        out, p = ctx.saved_tensors
        d_out = (torch.mul(grad, p, out=torch.empty_like(out))
                 if ctx.needs_input_grad[0] else None)
        d_p = (grad.float() * out).sum(-1, keepdim=True) if ctx.needs_input_grad[1] else None
        return d_out, d_p


def gate_output(out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Each routed token's expert output ``[T, H]`` times its gate ``probs`` ``[T]`` in
    ``out``'s dtype: SGLang's fused-MoE order (the gate after the down projection; see
    :class:`AlignedSequentialMLP`). Equal, forward and backward, to
    ``(out * probs.unsqueeze(-1)).to(out.dtype)``; for BF16 / FP16 outputs and fp32 gates
    (the router's) without that expression's fp32 ``[T, H]`` copies in the forward and in the
    output's gradient (the gate's own gradient still reduces an fp32 product)."""
    p = probs.unsqueeze(-1)
    if out.dtype in (torch.bfloat16, torch.float16) and p.dtype == torch.float32:
        return _GateOutput.apply(out, p)
    return (out * p).to(out.dtype)


class _ShardedActQuant(torch.autograd.Function):
    """Per-token activation quantization of an input split along its last dim over TP (STE)."""

    @staticmethod
    def forward(ctx, x, spec, group):  # noqa: D401
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        full = spec.fake_quant_activation(torch.cat(parts, dim=-1))
        return full.narrow(-1, dist.get_rank(group) * x.shape[-1], x.shape[-1]).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def quantize_input(state: AlignedForwardState, x: torch.Tensor, parallel_dim: int,
                   group: Any) -> torch.Tensor:
    """``Q_a(x)`` of a linear's input where the rollout quantizes activations (STE), else ``x``.

    ``parallel_dim`` 1 (row-parallel) with a tensor-parallel ``group`` of size > 1: the input is
    split along its features, so per-token scales are taken over the gathered row.
    """
    spec = state.spec
    if not spec.quantizes_activations or state.inputs_quantized:
        return x
    tp = group.size() if group is not None else 1
    if parallel_dim == 1 and tp > 1:
        if spec.activation == "per_token":
            return _ShardedActQuant.apply(x, spec, group)
        if x.shape[-1] % (spec.act_group or 1):
            raise ValueError(f"{spec.name}: row-parallel input has {x.shape[-1]} features per "
                             f"rank, not a multiple of the activation group {spec.act_group}")
    return spec.fake_quant_activation(x)


class AlignedLinearMixin:
    """The aligned GEMM shared by the column- and row-parallel linears."""

    _qrl_parallel_dim = 0

    def _qrl_setup(self, state: AlignedForwardState, kind: str, layout: FusionLayout) -> None:
        if not isinstance(state, AlignedForwardState):
            raise TypeError(f"qrl_state must be an AlignedForwardState, got {type(state).__name__}")
        self.qrl_state = state
        self.qrl_kind = kind
        self.qrl_layout = layout
        self.qrl_recomputes = 0
        self._qrl_cache: tuple[Any, torch.Tensor] | None = None
        self._qrl_codes: list[QuantizedWeight] | None = None
        # wgrad goes through autograd (the STE), not into main_grad by the fused kernel
        self.gradient_accumulation_fusion = False

    def _qrl_key(self) -> tuple[int, int, int]:
        w = self.weight
        return (self.qrl_state.version, w._version, w.data_ptr())

    def qrl_stale(self) -> bool:
        """True if the cached ``Q_w(W)`` is missing or older than the weights."""
        return self._qrl_cache is None or self._qrl_cache[0] != self._qrl_key()

    def qrl_store(self, q: torch.Tensor, codes: list[QuantizedWeight] | None = None) -> None:
        """Cache ``q`` as ``Q_w(W)`` of the current weights (computed by the caller) and, for
        the fake GEMM, ``codes``: the HF components' codes it was dequantized from."""
        self._qrl_cache = (self._qrl_key(), q)
        self._qrl_codes = codes
        self.qrl_recomputes += 1

    def qrl_codes(self) -> list[QuantizedWeight] | None:
        """Codes and scales of each HF tensor of this weight from the cached ``Q_w(W)``
        (refreshed first if stale: the step's one quantization), in HF order; None where
        the cache holds a tensor-parallel shard (the sync sends whole tensors)."""
        if _tp_size(self) > 1:
            return None
        state = self.qrl_state
        if state.gemm_for(self.qrl_kind) == "fake" and state.keep_codes and self._qrl_codes is None:
            self._qrl_cache = None  # cached before codes were kept
        q = self.quantized_weight()
        if isinstance(q, RealWeight):
            return real_codes(state.spec, q, self.qrl_layout, self.weight.dtype)
        return self._qrl_codes

    def quantized_weight(self) -> Any:
        """``Q_w(W)`` of this rank's shard, recomputed only after the weights changed: the
        dequantized weight (fake GEMM) or its codes and scales (:class:`RealWeight`). The
        weight's finiteness goes to the state's refresh checks, read once per refresh
        (:meth:`~.state.AlignedForwardState.check_finite`), not here."""
        if not self.qrl_stale():
            return self._qrl_cache[1]
        state, name = self.qrl_state, qrl_label(self)
        finite = state.finite_checks()
        if state.gemm_for(self.qrl_kind) == "real":
            rw = weight_operand(state.spec, self.weight, self._qrl_parallel_dim, self.tp_group,
                                name=name, layout=self.qrl_layout, finite=finite)
            self.qrl_store(replace(rw, keep_dequantized=state.keep_dequantized))
        elif state.keep_codes and _tp_size(self) == 1:
            codes = component_codes(state.spec, [self.weight], self.qrl_layout, name,
                                    finite)[0]
            self.qrl_store(fused_dequantized(state.spec, codes, self.qrl_layout), codes)
        else:
            self.qrl_store(quantize_shard(state.spec, self.weight, self.qrl_layout,
                                          self._qrl_parallel_dim, self.tp_group, name, finite))
        return self._qrl_cache[1]

    def _qrl_input(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_input(self.qrl_state, x, self._qrl_parallel_dim, self.tp_group)

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self.qrl_state.is_enabled(self.qrl_kind):
            return super()._forward_impl(input, weight, *args, **kwargs)
        if weight is not self.weight:
            raise RuntimeError(f"{type(self).__name__}: an external weight was passed to forward; "
                               "the aligned forward only quantizes its own parameter")
        if self.qrl_state.gemm_for(self.qrl_kind) == "real":
            return self._qrl_real_forward(input, **kwargs)
        q = _UseQuantized.apply(weight, self.quantized_weight())
        return super()._forward_impl(self._qrl_input(input), q, *args, **kwargs)

    def _qrl_real_forward(self, input: torch.Tensor, bias: torch.Tensor | None = None,
                          allreduce_dgrad: bool = False, sequence_parallel: bool = False,
                          tp_group: Any = None, **_: Any) -> torch.Tensor:
        """Megatron's local GEMM with its communication (sequence-parallel all-gather /
        dgrad all-reduce through megatron's mappings, not overlapped) around the real
        low-bit GEMM (:func:`~megatron_qrl.te_quant.real_gemm.real_linear`)."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        group = tp_group if tp_group is not None else self.tp_group
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, True, group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group)
        y = real_linear(input, self.weight, self.quantized_weight(), self.qrl_state.spec,
                        self._qrl_parallel_dim, self.tp_group, self.qrl_state.grad_fp8(),
                        self.qrl_state.wgrad_fp8())
        return y + bias if bias is not None else y


class AlignedColumnParallelLinear(AlignedLinearMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` computing with the rollout's quantized weight (STE)."""

    _qrl_parallel_dim = 0

    def __init__(self, *args: Any, qrl_state: AlignedForwardState, qrl_kind: str,
                 qrl_layout: FusionLayout = _PLAIN, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._qrl_setup(qrl_state, qrl_kind, qrl_layout)


class AlignedRowParallelLinear(AlignedLinearMixin, RowParallelLinear):
    """``RowParallelLinear`` computing with the rollout's quantized weight (STE)."""

    _qrl_parallel_dim = 1

    def __init__(self, *args: Any, qrl_state: AlignedForwardState, qrl_kind: str,
                 qrl_layout: FusionLayout = _PLAIN, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._qrl_setup(qrl_state, qrl_kind, qrl_layout)


def qrl_label(module: Any) -> str:
    """How errors name an aligned module's weight: its parameter name where
    :meth:`~.state.AlignedForwardState.name_modules` gave it one, else layer kind and class."""
    return getattr(module, "qrl_name", None) or f"{module.qrl_kind} {type(module).__name__}"


def _tp_size(linear: Any) -> int:
    group = getattr(linear, "tp_group", None)
    return group.size() if group is not None and dist.is_initialized() else 1


def _expert_activation(expert: Any, h: torch.Tensor) -> torch.Tensor:
    """The activation of megatron-core's ``MLP.forward`` without bias or per-token scale.

    The same elementwise maths as upstream's unfused path (and its fused ``bias_swiglu`` for
    SiLU GLU), applied to all experts' rows at once.
    """
    cfg = expert.config
    if cfg.use_te_activation_func or not cfg.gated_linear_unit:
        return expert.activation_func(h)
    x_glu, x_linear = torch.chunk(h, 2, dim=-1)
    clamp = getattr(cfg, "activation_func_clamp_value", None)
    if clamp is not None:
        x_glu = x_glu.clamp(min=None, max=clamp)
        x_linear = x_linear.clamp(min=-clamp, max=clamp)
    return cfg.activation_func(x_glu) * (x_linear + getattr(cfg, "glu_linear_offset", 0.0))


class AlignedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` that weights each expert's OUTPUT by its gate when activations are quantized.

    megatron-core multiplies the gate into the SwiGLU output before ``linear_fc2``
    (``fc2(Q_a(p * h))``); SGLang's fused MoE multiplies it after the down GEMM
    (``p * fc2(Q_a(h))``). Per-token quantization is scale invariant, so the forward agrees up
    to rounding, but the straight-through gradient into the gate differs (``<fc2^T g, h>`` vs
    ``<fc2^T g, Q_a(h)>``); this order is the rollout's. Without activation quantization the
    upstream code runs unchanged.
    """

    batched: bool = True
    """Quantize all local experts' weights, and their W8A8 inputs, in stacked calls (bit-identical
    to one call per expert; False runs the per-expert reference path)."""

    def __init__(self, *args: Any, qrl_state: AlignedForwardState, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qrl_state = qrl_state

    def _stacked(self) -> bool:
        """The stacked path applies: ``batched``, several local experts, none tensor-parallel
        (a sharded expert quantizes through :func:`quantize_shard`'s gathers)."""
        return (self.batched and self.num_local_experts > 1
                and all(_tp_size(e.linear_fc1) == 1 and _tp_size(e.linear_fc2) == 1
                        for e in self.local_experts))

    def refresh_quantized_weights(self) -> None:
        """Re-quantize the stale ``linear_fc1`` / ``linear_fc2`` of all local experts, one
        stacked call per projection (the per-expert lazy path remains the fallback)."""
        if (not self._stacked() or self.qrl_state.gemm_for("experts") == "real"
                or self.qrl_state.keep_codes):
            return  # the linears cache codes and scales, one expert at a time
        for attr in ("linear_fc1", "linear_fc2"):
            linears = [getattr(e, attr) for e in self.local_experts]
            if not any(lin.qrl_stale() for lin in linears):
                continue
            qs = quantize_shards_stacked(self.qrl_state.spec, [lin.weight for lin in linears],
                                         [lin.qrl_layout for lin in linears],
                                         name=f"experts {attr}",
                                         finite=self.qrl_state.finite_checks(),
                                         names=[qrl_label(lin) for lin in linears])
            for lin, q in zip(linears, qs or ()):
                lin.qrl_store(q)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        state = self.qrl_state
        if not state.is_enabled("experts"):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        self.refresh_quantized_weights()
        if not state.spec.quantizes_activations:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if self.config.add_bias_linear or self.config.moe_apply_probs_on_input:
            raise ValueError("aligned W8A8 experts support add_bias_linear=False and "
                             "moe_apply_probs_on_input=False (Qwen3-MoE)")
        if self._stacked() and state.gemm_for("experts") == "fake":
            out = self._w8a8_stacked(permuted_local_hidden_states, tokens_per_expert)
            return gate_output(out, permuted_probs), None
        ones = torch.ones_like(permuted_probs)
        out, bias = super().forward(permuted_local_hidden_states, tokens_per_expert, ones)
        return gate_output(out, permuted_probs), bias

    def _w8a8_stacked(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``fc2(Q_a(act(fc1(Q_a(x)))))`` per expert, each ``Q_a`` one call over all experts.

        Per-token (and per-token-group) quantization treats each row alone, so quantizing the
        concatenated rows equals quantizing each expert's rows (QaRL's aligned W8A8 forward).
        """
        spec = self.qrl_state.spec
        counts = tokens_per_expert.tolist()
        with self.qrl_state.inputs_prequantized():
            xs = torch.split(spec.fake_quant_activation(x), counts)
            h = torch.cat([e.linear_fc1(t)[0] for e, t in zip(self.local_experts, xs)], dim=0)
            h = spec.fake_quant_activation(_expert_activation(self.local_experts[0], h))
            hs = torch.split(h, counts)
            return torch.cat([e.linear_fc2(t)[0] for e, t in zip(self.local_experts, hs)], dim=0)
