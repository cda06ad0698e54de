"""Routed experts as one stacked weight per GEMM: no per-expert work on the host.

``--qrl-train-moe-experts stacked`` swaps the experts of every MoE layer spec for
:class:`StackedGroupedMLP`: megatron-core's ``TEGroupedMLP`` forward (router probabilities
multiplied into the SwiGLU output, ``moe_apply_probs_on_input`` as upstream, selective
``moe_act`` recompute) around two :class:`StackedGroupedLinear`, each holding ONE parameter
``weight`` of shape ``[local experts, out, in]`` (``linear_fc1``: ``[E, 2F, H]``, gate rows then
up rows per expert as megatron fuses them; ``linear_fc2``: ``[E, H, F]``). A forward is one
grouped GEMM per linear (:func:`megatron_qrl.models.grouped_gemm.grouped_mm`:
``torch._grouped_mm`` on CUDA BF16) and the backward is autograd's grouped-GEMM backward: no
Python loop over experts in either. Megatron's DDP and optimizer see two expert parameters per
layer instead of ``2 E``.

Why one ``nn.Parameter`` per GEMM and per-expert names outside: the GEMM reads the stack
directly (a per-expert parameter list would be copied into a stack every forward and its
gradient split every backward — the host work this path removes), while checkpoints, the HF
name map and slime's converters key on per-expert names. So the names stay per expert
everywhere a name leaves the module:

- ``state_dict`` writes ``linear_fc1.weight{i}`` (``TEGroupedMLP``'s keys) and
  ``load_state_dict`` reads them (or the stacked ``weight``);
- ``sharded_state_dict`` (torch_dist) writes each local expert as its GLOBAL expert's shard,
  the same sharded keys as ``TEGroupedMLP`` and ``SequentialMLP``: the checkpoints are
  interchangeable;
- :func:`megatron_qrl.models.mapping.per_expert_named` turns ``(name, stacked parameter)`` into per-expert
  ``(...linear_fc1.weight{i}, view)`` pairs for the HF streaming of weights and gradients
  (:mod:`megatron_qrl.models.streaming`), so :mod:`megatron_qrl.models.mapping` is unchanged.

Expert parallelism: the stack holds this rank's local experts only (megatron's contiguous
placement); expert tensor parallelism splits ``out`` (fc1) or ``in`` (fc2) as TE's grouped
linear does, and like it the linears never communicate (the token dispatcher does).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import TEGroupedMLP

from megatron_qrl.models.grouped_gemm import grouped_mm

__all__ = ["StackedColumnGroupedLinear", "StackedGroupedLinear", "StackedGroupedMLP",
           "StackedRowGroupedLinear", "grouped_sharded_state_dict",
           "stacked_experts_spec_hook"]

NO_BIAS = ("--qrl-train-moe-experts stacked: experts without bias only (add_bias_linear=False, "
           "as Qwen3-MoE); use --qrl-train-moe-experts megatron for biased experts")
"""The refusal of biased experts (the spec hook and the linear say the same)."""


def _pg_size_rank(group: Any) -> tuple[int, int]:
    from megatron.core.utils import get_pg_rank, get_pg_size

    return get_pg_size(group), get_pg_rank(group)


def expert_groups(config: Any, pg_collection: Any) -> tuple[Any, Any, int, bool]:
    """``(pg_collection, expert TP group, its size, expert parallel?)`` of a grouped expert
    linear; ``pg_collection`` None: megatron's global (mpu) groups."""
    if pg_collection is None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    tp, _ = _pg_size_rank(pg_collection.expt_tp)
    return pg_collection, pg_collection.expt_tp, tp, config.expert_model_parallel_size > 1


def grouped_sharded_state_dict(weights: list[torch.Tensor], extra_state: Any, prefix: str,
                               sharded_offsets: tuple, metadata: dict | None, row: bool,
                               pg_collection: Any, tp_group: Any) -> dict:
    """Each local expert's weight (``weights[i]``, this rank's TP shard) as its global
    expert's shard under ``{prefix}weight{i}``, plus ``_extra_state`` entries (TE's
    ``TEGroupedLinear._sharded_state_dict_grouped``, megatron-core 0.16.1)."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = metadata.get("singleton_local_shards", False)
    ep_size, ep_rank = _pg_size_rank(pg_collection.ep)
    n_local = len(weights)
    n_global, first = ep_size * n_local, ep_rank * n_local
    out: dict[str, Any] = {}
    for i, weight in enumerate(weights):
        g = first + i
        local = {f"{i}.weight": weight, f"{i}._extra_state": extra_state}
        offsets = (sharded_offsets if singleton
                   else (*sharded_offsets, (len(sharded_offsets), g, n_global)))
        sub = make_sharded_tensors_for_checkpoint(
            local, "", {f"{i}.weight": 1 if row else 0}, offsets, tp_group=tp_group,
            dp_cp_group=metadata["dp_cp_group"])
        replace_prefix_for_sharding(sub, f"{i}.", f"{g}.{prefix}" if singleton else prefix)
        out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
        out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
    _, edp_rank = _pg_size_rank(pg_collection.expt_dp)
    for sh in out.values():  # replicated along DP modulo EP
        full = getattr(sh, "is_data_parallel_fully_shard", False)
        sh.replica_id = (*sh.replica_id[:2], 0 if full else edp_rank)
    return out


class StackedGroupedLinear(MegatronModule):
    """All local experts' linear as one ``weight`` ``[num_gemms, out, in]``, one grouped GEMM.

    Built by ``TEGroupedMLP`` with ``TEGroupedLinear``'s arguments; names per expert outside
    (module docstring)."""

    parallel_mode = "column"
    """``column`` (``out`` split over expert TP) or ``row`` (``in`` split)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any,
                 init_method: Any, bias: bool, skip_bias_add: bool, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if not is_expert:
            raise ValueError("StackedGroupedLinear holds routed experts only (is_expert=True)")
        if bias:
            raise ValueError(NO_BIAS)
        self._pg_collection, self.tp_group, tp, self.expert_parallel = expert_groups(
            config, pg_collection)
        self.num_gemms = num_gemms
        self.in_features = input_size // tp if self.parallel_mode == "row" else input_size
        self.out_features = output_size // tp if self.parallel_mode == "column" else output_size
        self.use_bias = False
        self.weight = torch.nn.Parameter(self._new_weight(config, init_method))
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 2 if self.parallel_mode == "row" else 1
        self.weight.partition_stride = 1
        self.weight.allreduce = not self.expert_parallel  # megatron DDP: expert-DP reduction
        self._register_state_dict_hook(_per_expert_state_dict)
        self._register_load_state_dict_pre_hook(self._stack_loaded)

    def _new_weight(self, config: Any, init_method: Any) -> torch.Tensor:
        """Each expert's slice initialised by ``init_method`` (under the expert-parallel RNG
        tracker on a GPU, as TE's grouped linear), on the device TE would use."""
        cuda = torch.cuda.is_available() and not config.use_cpu_initialization
        meta = config.init_model_with_meta_device and not config.use_cpu_initialization
        device = "meta" if meta else (torch.cuda.current_device() if cuda else "cpu")
        w = torch.empty(self.num_gemms, self.out_features, self.in_features,
                        dtype=config.params_dtype, device=device)
        if config.perform_initialization and not meta:
            if cuda:
                from megatron.core.tensor_parallel.random import (
                    get_cuda_rng_tracker,
                    get_expert_parallel_rng_tracker_name,
                )

                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    for e in range(self.num_gemms):
                        init_method(w[e])
            else:
                for e in range(self.num_gemms):
                    init_method(w[e])
        return w

    def _stack_loaded(self, state_dict: dict, prefix: str, *args: Any) -> None:
        """``weight{i}`` (and TE's per-expert ``_extra_state{i}``) -> the stacked ``weight``."""
        keys = [f"{prefix}weight{i}" for i in range(self.num_gemms)]
        if any(k in state_dict for k in keys):
            missing = [k for k in keys if k not in state_dict]
            if missing:
                raise KeyError(f"{prefix}: the state dict lacks {missing[0]} (it holds some "
                               "experts of this stack only)")
            state_dict[f"{prefix}weight"] = torch.stack([state_dict.pop(k) for k in keys])
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if key[len(prefix):].startswith("_extra_state"):
                state_dict.pop(key)

    def backward_dw(self) -> None:
        """Weight gradients come from autograd at backward time (nothing deferred)."""

    def forward(self, x: torch.Tensor, m_splits: Any) -> tuple[torch.Tensor, None]:
        """``cat_e(x_e @ W_e^T)`` over the token groups ``m_splits`` as ONE grouped GEMM."""
        return grouped_mm(x, self.weight, m_splits), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Per expert, as ``TEGroupedLinear`` (:func:`grouped_sharded_state_dict`)."""
        return grouped_sharded_state_dict(list(self.weight.unbind(0)), None, prefix,
                                          sharded_offsets, metadata,
                                          self.parallel_mode == "row", self._pg_collection,
                                          self.tp_group)


def _per_expert_state_dict(module: StackedGroupedLinear, state_dict: dict, prefix: str,
                           local_metadata: Any) -> None:
    """``state_dict`` hook: the stacked ``weight`` written as ``weight{i}`` per expert."""
    stacked = state_dict.pop(f"{prefix}weight")
    for i, view in enumerate(stacked.unbind(0)):
        state_dict[f"{prefix}weight{i}"] = view
    state_dict[f"{prefix}_extra_state"] = None


class StackedColumnGroupedLinear(StackedGroupedLinear):
    """The experts' ``linear_fc1`` (``TEColumnParallelGroupedLinear``'s place)."""

    parallel_mode = "column"


class StackedRowGroupedLinear(StackedGroupedLinear):
    """The experts' ``linear_fc2`` (``TERowParallelGroupedLinear``'s place)."""

    parallel_mode = "row"


class StackedGroupedMLP(TEGroupedMLP):
    """``TEGroupedMLP`` (upstream forward and sharded state dict) over stacked linears; a class
    of its own so that spec hooks tell it from TE's grouped experts."""


def stacked_experts_spec_hook(layer_spec: Any, config: Any) -> Any:
    """A ``models.builder.SpecHook``: the MoE layer's experts become :class:`StackedGroupedMLP`
    (dense layers are returned unchanged)."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_qrl.models.spec_tree import copy_spec

    if layer_spec.submodules.mlp.module is not MoELayer:
        return layer_spec
    spec = copy_spec(layer_spec)
    moe_sub = spec.submodules.mlp.submodules
    experts = moe_sub.experts
    if experts.module not in (SequentialMLP, TEGroupedMLP):
        raise ValueError(f"--qrl-train-moe-experts stacked: the layer spec's experts are "
                         f"{experts.module.__name__}; it replaces SequentialMLP or TEGroupedMLP")
    if config.add_bias_linear:
        raise ValueError(NO_BIAS)
    sub = MLPSubmodules(linear_fc1=StackedColumnGroupedLinear,
                        linear_fc2=StackedRowGroupedLinear)
    moe_sub.experts = ModuleSpec(module=StackedGroupedMLP, submodules=sub)
    return spec
