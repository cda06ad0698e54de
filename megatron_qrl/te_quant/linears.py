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

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_qrl.te_quant.shard_quant import FusionLayout, quantize_shard
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
        # wgrad goes through autograd (the STE), not into main_grad by the fused kernel
        self.gradient_accumulation_fusion = False

    def quantized_weight(self) -> torch.Tensor:
        """``Q_w(W)`` of this rank's shard, recomputed only after the weights changed."""
        w = self.weight
        key = (self.qrl_state.version, w._version, w.data_ptr())
        if self._qrl_cache is None or self._qrl_cache[0] != key:
            q = quantize_shard(self.qrl_state.spec, w, self.qrl_layout, self._qrl_parallel_dim,
                               self.tp_group, name=f"{self.qrl_kind} {type(self).__name__}")
            self._qrl_cache = (key, q)
            self.qrl_recomputes += 1
        return self._qrl_cache[1]

    def _qrl_input(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.qrl_state.spec
        if not spec.quantizes_activations:
            return x
        tp = self.tp_group.size() if self.tp_group is not None else 1
        if self._qrl_parallel_dim == 1 and tp > 1:
            if spec.activation == "per_token":
                return _ShardedActQuant.apply(x, spec, self.tp_group)
            if x.shape[-1] % (spec.act_group or 1):
                raise ValueError(f"{spec.name}: row-parallel input has {x.shape[-1]} features per "
                                 f"rank, not a multiple of the activation group {spec.act_group}")
        return spec.fake_quant_activation(x)

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not self.qrl_state.is_enabled(self.qrl_kind):
            return super()._forward_impl(input, weight, *args, **kwargs)
        if weight is not self.weight:
            raise RuntimeError(f"{type(self).__name__}: an external weight was passed to forward; "
                               "the aligned forward only quantizes its own parameter")
        q = _UseQuantized.apply(weight, self.quantized_weight())
        return super()._forward_impl(self._qrl_input(input), q, *args, **kwargs)


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


class AlignedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` that weights each expert's OUTPUT by its gate when activations are quantized.

    megatron-core multiplies the gate into the SwiGLU output before ``linear_fc2``
    (``fc2(Q_a(p * h))``); SGLang's fused MoE multiplies it after the down GEMM
    (``p * fc2(Q_a(h))``). Per-token quantization is scale invariant, so the forward agrees up
    to rounding, but the straight-through gradient into the gate differs (``<fc2^T g, h>`` vs
    ``<fc2^T g, Q_a(h)>``); this order is the rollout's. Without activation quantization the
    upstream code runs unchanged.
    """

    def __init__(self, *args: Any, qrl_state: AlignedForwardState, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.qrl_state = qrl_state

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        state = self.qrl_state
        if not (state.is_enabled("experts") and state.spec.quantizes_activations):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if self.config.add_bias_linear or self.config.moe_apply_probs_on_input:
            raise ValueError("aligned W8A8 experts support add_bias_linear=False and "
                             "moe_apply_probs_on_input=False (Qwen3-MoE)")
        ones = torch.ones_like(permuted_probs)
        out, bias = super().forward(permuted_local_hidden_states, tokens_per_expert, ones)
        return (out * permuted_probs.unsqueeze(-1)).to(out.dtype), bias
