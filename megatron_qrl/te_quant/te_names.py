"""Rollout-aligned stand-ins for Megatron's Transformer Engine linears that KEEP TE's names.

On Megatron's TE layer spec the attention and dense-MLP linears are
``TELayerNormColumnParallelLinear`` (the pre-norm fused in: ``layer_norm_weight``
[+ ``layer_norm_bias``], ``weight`` [+ ``bias``]), ``TEColumnParallelLinear`` and
``TERowParallelLinear`` (``megatron/core/extensions/transformer_engine.py``). Weight sync
(slime's ``megatron_to_hf`` converters), torch_dist checkpoints and our own name maps key on
those names, so the aligned forward (QaRL, Fan et al. 2025: ``y = Q_a(x) @ Q_w(W)^T`` with a
straight-through gradient, Bengio et al. 2013) swaps in modules with the SAME parameter names,
shapes, tensor-parallel attributes and state-dict entries (``_extra_state``), built from the
spec — pure torch, no TE needed, so they also run on CPU:

- :class:`AlignedTELayerNormColumnParallelLinear`: the norm (RMSNorm / LayerNorm per
  ``config.normalization``, ``layernorm_zero_centered_gamma``) on this rank's tokens, then
  :class:`~megatron_qrl.te_quant.linears.AlignedColumnParallelLinear` (Megatron's
  ``ColumnParallelLinear`` TP mappings: copy-to-TP / sequence-parallel all-gather of the
  normalised input, as TE's ``LayerNormLinear`` does), activation fake-quant where the format
  quantizes activations, GEMM with the cached fake-quantized weight (STE).
- :class:`AlignedTEColumnParallelLinear` / :class:`AlignedTERowParallelLinear`: the aligned
  column / row linears with TE's parameter attributes and ``_extra_state``.

Parameter attributes follow TE 2.x (``module/linear.py``, ``layernorm_linear.py``
``reset_parameters``) and Megatron's wrappers: weights ``tensor_model_parallel=True``,
``partition_dim`` 0 (column) / 1 (row; 0 for expert linears whose TP communication Megatron
handles outside TE), ``partition_stride`` as the spec's ``stride``; norm gains
``sequence_parallel``; ``allreduce`` as Megatron sets it. ``_extra_state`` is TE's FP8
metadata: an empty ``uint8`` tensor here (the aligned forward runs no TE FP8 recipe); a state
loaded from a TE checkpoint is kept and written back unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_qrl.te_quant.linears import AlignedColumnParallelLinear, AlignedRowParallelLinear

NORMALIZATIONS = ("RMSNorm", "LayerNorm")


class TEExtraState:
    """``get_extra_state`` / ``set_extra_state`` as Transformer Engine modules have them.

    TE's ``TransformerEngineBaseModule.get_extra_state`` returns ``torch.empty(0, uint8)``
    without FP8 metadata, else the pickled metadata as a ``uint8`` tensor; torch_dist
    checkpoints hold it as a ``ShardedObject``. A loaded non-empty state is kept verbatim.
    """

    _qrl_te_extra: torch.Tensor | None = None

    def get_extra_state(self) -> torch.Tensor:
        extra = self._qrl_te_extra
        return extra if extra is not None else torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            self._qrl_te_extra = None
        elif isinstance(state, torch.Tensor):
            self._qrl_te_extra = state.detach().cpu()
        else:
            raise TypeError(f"{type(self).__name__}: unsupported _extra_state {type(state).__name__}"
                            " (Transformer Engine checkpoints hold a uint8 tensor)")


def set_te_parallel_attributes(param: torch.Tensor, partition_dim: int, stride: int = 1) -> None:
    """What TE's ``set_tensor_model_parallel_attributes`` puts on a sharded weight."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


class AlignedTEColumnParallelLinear(TEExtraState, AlignedColumnParallelLinear):
    """``TEColumnParallelLinear``'s names and attributes, computing with the rollout's weight."""

    def __init__(self, *args: Any, stride: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, stride=stride, **kwargs)
        set_te_parallel_attributes(self.weight, 0, stride)
        if self.bias is not None:
            set_te_parallel_attributes(self.bias, 0, stride)


class AlignedTERowParallelLinear(TEExtraState, AlignedRowParallelLinear):
    """``TERowParallelLinear``'s names and attributes, computing with the rollout's weight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # TE sets partition_dim 1 only in its "row" mode; Megatron gives expert linears with
        # explicit communication (expert TP or EP > 1) TE's mode None, hence dim 0
        set_te_parallel_attributes(self.weight, 0 if self.explicit_expert_comm else 1)
        if self.bias is not None:
            self.bias.sequence_parallel = self.sequence_parallel


class AlignedTELayerNormColumnParallelLinear(AlignedTEColumnParallelLinear):
    """``TELayerNormColumnParallelLinear``: pre-norm + aligned column-parallel linear, TE's names.

    ``norm(x)`` (Zhang & Sennrich 2019 RMSNorm: ``x / sqrt(mean(x^2) + eps) * g``; or
    LayerNorm), ``g = 1 + gamma`` with ``layernorm_zero_centered_gamma``, then
    ``Q_a(norm(x)) @ Q_w(W)^T`` (STE). The norm runs on this rank's (sequence-parallel) tokens
    before the all-gather, as TE's ``LayerNormLinear`` does.
    """

    def __init__(self, *args: Any, config: Any, **kwargs: Any) -> None:
        super().__init__(*args, config=config, **kwargs)
        if config.normalization not in NORMALIZATIONS:
            raise ValueError(f"aligned TELayerNormColumnParallelLinear: normalization "
                             f"{config.normalization!r} not in {NORMALIZATIONS}")
        self.normalization = config.normalization
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        self.eps = config.layernorm_epsilon
        like = dict(device=self.weight.device, dtype=self.weight.dtype)
        linear_params = dict(self._parameters)
        self._parameters.clear()  # TE registers the norm's parameters first
        gain = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(gain(self.input_size, **like))
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(self.input_size, **like))
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        else:
            self.layer_norm_bias = None
        self._parameters.update(linear_params)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The fused pre-norm of TE's ``LayerNormLinear``."""
        gain = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        shape = (self.input_size,)
        if self.normalization == "RMSNorm":
            return F.rms_norm(x, shape, gain, self.eps)
        return F.layer_norm(x, shape, gain, self.layer_norm_bias, self.eps)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, Any]:
        return super().forward(self.norm(input_), weight, runtime_gather_output)


TE_LINEAR_SWAPS: dict[str, type] = {
    "TELayerNormColumnParallelLinear": AlignedTELayerNormColumnParallelLinear,
    "TEColumnParallelLinear": AlignedTEColumnParallelLinear,
    "TERowParallelLinear": AlignedTERowParallelLinear,
}
"""Megatron TE linear class name -> its name-keeping aligned stand-in (the spec hook's table)."""
