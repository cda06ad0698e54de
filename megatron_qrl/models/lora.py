"""LoRA adapters on megatron-core's column- and row-parallel linears, swapped in by the layer spec.

LoRA (Hu et al. 2021, eq. 3): ``y = W0 x + (alpha / r) * B (A dropout(x))``, ``B = 0`` at init
(so the model starts as the base), ``W0`` frozen. One adapter per HF projection ("canonical":
Megatron's fused ``linear_qkv`` gets separate q / k / v adapters, ``linear_fc1`` gate / up),
so adapters are PEFT's and SGLang's without conversion. Sharding follows the base:

- ColumnParallelLinear (output split): ``A`` replicated ``[r, in]``, ``B`` sharded
  ``[out/tp, r]``; ``A``'s gradient is a partial sum per rank and is all-reduced over TP
  (``copy_to_tensor_model_parallel_region`` on ``A``), the adapter's input gradient joins the
  base's TP reduction (copy / sequence-parallel gather on the adapter input).
- RowParallelLinear (input split): ``A`` sharded ``[r, in/tp]``, ``B`` replicated ``[out, r]``;
  the partial ``B A x`` joins the base's output reduction, ``B``'s gradient is all-reduced.

Before :func:`freeze_base` the base ``weight`` is a normal parameter (the supervised warm-up
trains it) and the adapters are inactive; :func:`freeze_base` moves it into a frozen
:mod:`~megatron_qrl.models.lora_base` storage (bf16, NF4 or a rollout format's codes),
dequantized per forward, and turns the adapters on. No megatron class is patched.

Across forward -> backward a frozen base keeps only its storage (QLoRA, Dettmers et al. 2023,
sec. 3, eqs. 5-6: the NF4 storage stays resident and is dequantized to BF16 whenever the
weight is used, in the forward and again for the backward's dX): :func:`redequantize_in_backward` replaces the dequantized
weight that megatron's frozen-weight GEMM saves for its input-gradient GEMM by a token and
dequantizes again when the backward unpacks it.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_qrl.models.lora_config import LoraConfig

__all__ = ["LoraColumnParallelLinear", "LoraRowParallelLinear", "LoraSetup", "LoraState",
           "decoder_input_requires_grad", "freeze_all_but_adapters", "freeze_base",
           "lora_linears", "lora_spec_hook", "redequantize_in_backward"]


@dataclass
class LoraState:
    """Shared by every LoRA linear of a model: adapters on/off (off during the warm-up)."""

    config: LoraConfig
    active: bool = False


@dataclass(frozen=True)
class LoraSetup:
    """What one swapped linear carries: its HF projections and which of them get adapters."""

    state: LoraState
    projections: tuple[str, ...]
    """HF projections fused in this linear, in Megatron's order (q,k,v / gate,up / one)."""
    adapted: tuple[str, ...]
    """The subset that gets adapters."""
    kind: str = "plain"
    """plain | qkv | gate_up."""
    heads_per_group: int = 1
    head_dim: int = 0


@contextlib.contextmanager
def redequantize_in_backward(weight: torch.Tensor,
                             dequantize: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Autograd saves ``weight`` (``dequantize()``'s output) as a token inside this block; the
    backward gets ``dequantize()`` again — bit-identical (elementwise code lookups and scale
    products, deterministic), so gradients are unchanged — and frees it after the node's
    backward. The BF16 weight lives per layer only while its GEMMs run (QLoRA, Dettmers et
    al. 2023, sec. 3, eqs. 5-6), at the cost of one more dequantize per layer in the backward.

    Why saved-tensor hooks and not an own autograd.Function: the GEMM stays megatron's
    (``linear_with_frozen_weight`` with its TP all-reduce / sequence-parallel gather and
    reduce-scatter), unpatched. Only the weight is recognised (by identity, through a weak
    reference, so the hooks that autograd keeps with each saved tensor do not hold it);
    anything else saved in the block is kept as is (megatron-core 0.16.1 saves nothing else
    there). The innermost hooks win: an outer ``saved_tensors_hooks`` sees nothing saved in
    the block.
    Megatron's activation recomputation (``--recompute-granularity full``) re-runs the
    forward, and with it this block, under its reentrant checkpoint: the recomputed forward
    saves its own token.
    """
    ref, token = weakref.ref(weight), object()

    def pack(t: torch.Tensor) -> Any:
        return token if t is ref() else t

    def unpack(saved: Any) -> torch.Tensor:
        return dequantize() if saved is token else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _tp(module: Any) -> tuple[int, int]:
    g = getattr(module, "tp_group", None)
    if g is None or not torch.distributed.is_initialized():
        return 0, 1
    return g.rank(), g.size()


class _LoraMixin:
    """Adapters, base storage and the forward shared by both linears."""

    _qrl_parallel_dim = 0
    qrl_redequantize = True
    """Frozen base: dequantize again in the backward instead of keeping the weight (tests
    turn it off for the reference). A bf16 base's ``dequantize`` is its buffer: the same
    tensor comes back, nothing is saved or recomputed either way."""

    def _lora_setup(self, setup: LoraSetup, in_full: int, out_parts: list[int]) -> None:
        cfg = setup.state.config
        self.qrl_lora = setup
        self.qrl_base = None  # a lora_base storage once frozen
        self.gradient_accumulation_fusion = False
        rank, tp = _tp(self)
        dtype = self.config.params_dtype
        device = next(iter(self.parameters())).device
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for proj, out in zip(setup.projections, out_parts):
            if proj not in setup.adapted:
                continue
            a_full = torch.empty(cfg.rank, in_full, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5))  # PEFT's init of A
            if self._qrl_parallel_dim == 1:
                a = a_full.chunk(tp, dim=1)[rank]
                b_shape = (out, cfg.rank)
            else:
                a, b_shape = a_full, (out // tp, cfg.rank)
            self.lora_A[proj] = torch.nn.Parameter(a.to(device, dtype).contiguous())
            self.lora_B[proj] = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))
            sharded = self.lora_A[proj] if self._qrl_parallel_dim == 1 else self.lora_B[proj]
            set_tensor_model_parallel_attributes(sharded, True, self._qrl_parallel_dim, 1)
            for p in (self.lora_A[proj], self.lora_B[proj]):  # expert params: expert DP
                p.allreduce = getattr(self.weight, "allreduce", True)

    # ---- base ------------------------------------------------------------------------
    @property
    def qrl_frozen(self) -> bool:
        return self.qrl_base is not None

    def base_weight(self) -> torch.Tensor:
        """The base weight this rank computes with (dequantized storage once frozen)."""
        return self.qrl_base.dequantize() if self.qrl_frozen else self.weight

    # ---- adapter maths -----------------------------------------------------------------
    def _replicated(self, p: torch.Tensor) -> torch.Tensor:
        """A replicated adapter factor whose gradient is a partial sum per TP rank."""
        return copy_to_tensor_model_parallel_region(p, group=self.tp_group) if _tp(self)[1] > 1 else p

    def _adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """``(alpha/r) B A dropout(x)`` in this rank's output layout (None when inactive)."""
        setup = self.qrl_lora
        if not setup.state.active or not len(self.lora_A):
            return None
        cfg = setup.state.config
        x = self._adapter_input(x)
        if cfg.dropout and self.training:
            x = torch.nn.functional.dropout(x, cfg.dropout)
        outs = []
        for proj, width in zip(setup.projections, self._qrl_out_local):
            if proj not in self.lora_A:
                outs.append(x.new_zeros(*x.shape[:-1], width))
                continue
            a, b = self.lora_A[proj], self.lora_B[proj]
            if self._qrl_parallel_dim == 0:
                a = self._replicated(a)
            else:
                b = self._replicated(b)
            outs.append(torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * cfg.scaling)
        return self._fuse(outs)

    def _fuse(self, outs: list[torch.Tensor]) -> torch.Tensor:
        setup = self.qrl_lora
        if setup.kind == "qkv":
            q, k, v = outs
            lead = q.shape[:-1]
            groups = k.shape[-1] // setup.head_dim
            return torch.cat([q.reshape(*lead, groups, -1), k.reshape(*lead, groups, -1),
                              v.reshape(*lead, groups, -1)], dim=-1).reshape(*lead, -1)
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]

    def _lora_forward_impl(self, input, weight, *args, **kwargs):
        if weight is None:
            weight = self.qrl_base.dequantize()
        saving = (redequantize_in_backward(weight, self.qrl_base.dequantize)
                  if self.qrl_frozen and self.qrl_redequantize else contextlib.nullcontext())
        with saving:
            out = super()._forward_impl(input, weight, *args, **kwargs)
        delta = self.lora_delta(input)
        return out if delta is None else out + delta.to(out.dtype)


def _out_parts(setup: LoraSetup, out_full: int) -> list[int]:
    if setup.kind == "gate_up":
        return [out_full // 2, out_full // 2]
    if setup.kind == "qkv":
        per = (setup.heads_per_group + 2) * setup.head_dim
        groups = out_full // per
        return [groups * setup.heads_per_group * setup.head_dim, groups * setup.head_dim,
                groups * setup.head_dim]
    return [out_full]


class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` + per-projection adapters (A replicated, B sharded on dim 0)."""

    _qrl_parallel_dim = 0

    def __init__(self, input_size: int, output_size: int, *args: Any, qrl_lora: LoraSetup,
                 **kwargs: Any) -> None:
        super().__init__(input_size, output_size, *args, **kwargs)
        parts = _out_parts(qrl_lora, output_size)
        self._lora_setup(qrl_lora, input_size, parts)
        self._qrl_out_local = [p // _tp(self)[1] for p in parts]

    def _adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        if _tp(self)[1] == 1 or self.explicit_expert_comm or self.disable_grad_reduce:
            return x
        if self.sequence_parallel:  # the base gathers inside its GEMM; the adapter here
            return gather_from_sequence_parallel_region(x, True, group=self.tp_group)
        if self.allreduce_dgrad:  # the base all-reduces its dgrad inside its GEMM
            return copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        return x  # forward() already copied the input to the TP region

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is None and self.qrl_frozen:
            weight = self.qrl_base.dequantize()
        return super().forward(input_, weight, runtime_gather_output)

    def _forward_impl(self, input, weight, *args, **kwargs):
        return self._lora_forward_impl(input, weight, *args, **kwargs)


class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
    """``RowParallelLinear`` + adapters (A sharded on dim 1, B replicated)."""

    _qrl_parallel_dim = 1

    def __init__(self, input_size: int, output_size: int, *args: Any, qrl_lora: LoraSetup,
                 **kwargs: Any) -> None:
        super().__init__(input_size, output_size, *args, **kwargs)
        self._lora_setup(qrl_lora, input_size, [output_size])
        self._qrl_out_local = [output_size]

    def _adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        return x  # already this rank's input shard; the output reduction sums B A_r x_r

    def _forward_impl(self, input, weight, *args, **kwargs):
        return self._lora_forward_impl(input, weight, *args, **kwargs)


def lora_linears(model: torch.nn.Module) -> list[tuple[str, _LoraMixin]]:
    """``(module name, linear)`` of every LoRA linear in ``model`` (DDP wrappers stripped)."""
    return [(n.removeprefix("module."), m) for n, m in model.named_modules()
            if isinstance(m, _LoraMixin)]


def freeze_all_but_adapters(model: torch.nn.Module) -> None:
    """``requires_grad`` only on adapters. Called before megatron DDP wraps the model (a run
    without warm-up), DDP then allocates gradient buffers for the adapters alone. With
    activation recomputation the word embedding's output is made to require grad
    (:func:`decoder_input_requires_grad`)."""
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    decoder_input_requires_grad(model)


def _input_requires_grad(module: Any, args: Any, output: torch.Tensor) -> None:
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)  # a leaf: nothing upstream requires grad


def decoder_input_requires_grad(model: torch.nn.Module) -> int:
    """Make the decoder input of a ``model`` with activation recomputation require grad;
    returns the hooked embeddings (0 without recomputation, or on a pipeline stage without
    the embedding: megatron's received activations require grad).

    Megatron's activation recomputation (``--recompute-granularity full``) wraps layers in
    a reentrant checkpoint (``tensor_parallel.random.CheckpointFunction``), which only
    back-propagates when its input requires grad; a frozen embedding's output does not, so
    the recomputed layers' adapters would get no gradient (megatron's schedule skips the
    backward of a loss that does not require grad). As PEFT's ``enable_input_require_grads``:
    a forward hook on the embedding marks its output (a leaf there, sequence-parallel
    scatter included) as requiring grad. The embedding's weight stays frozen (no gradient,
    no optimizer state); the cost, the first layer's input gradient, is paid only with
    recomputation (any granularity). Idempotent."""
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )

    n = 0
    for module in model.modules():
        if (isinstance(module, LanguageModelEmbedding)
                and getattr(module.config, "recompute_granularity", None) is not None):
            if getattr(module, "_qrl_input_grad_hook", None) is None:
                module._qrl_input_grad_hook = module.register_forward_hook(_input_requires_grad)
            n += 1
    return n


def freeze_base(model: torch.nn.Module, make_storage: Callable[[str, Any], Any]) -> int:
    """Freeze every parameter but the adapters; move LoRA bases into ``make_storage(name,
    linear)`` (a :mod:`lora_base` storage); turn the adapters on. Returns the adapter count."""
    linears = lora_linears(model)
    if not linears:
        raise ValueError("freeze_base: the model has no LoRA linears (build it with "
                         "lora_spec_hook)")
    freeze_all_but_adapters(model)
    for name, lin in linears:
        if lin.qrl_frozen:
            continue
        storage = make_storage(name, lin)
        del lin._parameters["weight"]
        lin.weight = None
        lin.qrl_base = storage
    linears[0][1].qrl_lora.state.active = True
    return sum(len(lin.lora_A) for _, lin in linears)


def _setup(state: LoraState, projections: tuple[str, ...], kind: str = "plain",
           heads_per_group: int = 1, head_dim: int = 0, adapters: bool = True) -> LoraSetup:
    adapted = tuple(p for p in projections if adapters and p in state.config.targets)
    return LoraSetup(state, projections, adapted, kind, heads_per_group, head_dim)


def _spec(cls: type, setup: LoraSetup) -> Any:
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=cls, params={"qrl_lora": setup})


def _swap_mlp(sub: Any, state: LoraState, adapters: bool) -> None:
    """gate/up (fused fc1) and down (fc2); ``adapters=False``: frozen base only."""
    sub.linear_fc1 = _spec(LoraColumnParallelLinear, _setup(
        state, ("gate_proj", "up_proj"), "gate_up", adapters=adapters))
    sub.linear_fc2 = _spec(LoraRowParallelLinear, _setup(state, ("down_proj",),
                                                         adapters=adapters))


def lora_spec_hook(state: LoraState) -> Callable[[Any, Any], Any]:
    """A ``spec_hook(layer_spec, config)`` swapping attention, dense MLP and expert linears for
    LoRA linears (adapters on ``state.config.targets``; experts' only with ``experts``).

    Every linear the rollout quantizes is swapped, adapters or not, so the whole base can be
    held in the base format. The local spec only (the TE spec's fused norm-linears and grouped
    experts: a clear error).
    """
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_qrl.models.spec_tree import copy_spec

    def hook(layer_spec: Any, config: Any) -> Any:
        spec = copy_spec(layer_spec)
        sub = spec.submodules
        attn = sub.self_attention.submodules
        if getattr(attn.linear_qkv, "__name__", "") == "TELayerNormColumnParallelLinear":
            raise ValueError("--qrl-lora-rank > 0 runs on megatron-core's local spec; the "
                             "Transformer Engine spec is not supported with LoRA yet")
        hpg = config.num_attention_heads // config.num_query_groups
        attn.linear_qkv = _spec(LoraColumnParallelLinear, _setup(
            state, ("q_proj", "k_proj", "v_proj"), "qkv", hpg, config.kv_channels))
        attn.linear_proj = _spec(LoraRowParallelLinear, _setup(state, ("o_proj",)))
        if sub.mlp.module is MoELayer:
            experts = sub.mlp.submodules.experts
            if experts.module is not SequentialMLP or not isinstance(experts.submodules,
                                                                     MLPSubmodules):
                raise ValueError("LoRA needs SequentialMLP experts (moe_grouped_gemm=False)")
            _swap_mlp(experts.submodules, state, state.config.experts)
        else:
            _swap_mlp(sub.mlp.submodules, state, True)
        return spec

    return hook
