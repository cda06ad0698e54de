"""Quantize a tensor-parallel SHARD of a (possibly fused) Megatron weight exactly as the rollout does.

The rollout quantizes the HF tensors (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ...)
whole. A Megatron rank holds a shard of a fused weight: ``linear_qkv`` interleaved per query
group, ``linear_fc1`` as ``[gate_r; up_r]``, row-parallel weights split along the input dim.
:func:`quantize_shard` splits the local weight into its HF components, quantizes each one as
the matching slice of the HF tensor and re-fuses, so the result equals the rows/columns of
``spec.dequantize(spec.quantize_weight(hf_tensor))`` that this rank holds, bit for bit:

- per-tensor scales (NVFP4's ``weight_scale_2``): the amax is the max over the fused group's
  members (SGLang fuses q/k/v and gate/up, see ``quant.targets.fusion_group``) and is
  all-reduced (MAX) over the tensor-parallel group;
- block / group scales: exact when no block straddles two shards, i.e. when the shard's extent
  along the split dimension is a multiple of the block; otherwise a clear error;
- per-output-channel scales on a row-parallel (input-split) weight span every shard: the full
  weight is all-gathered once (the result is cached until the next optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_qrl.models.layout import fuse_qkv, split_qkv
from megatron_qrl.quant import QuantSpec
from megatron_qrl.quant.finite_checks import FiniteChecks


@dataclass(frozen=True)
class FusionLayout:
    """How a Megatron weight is made of HF tensors (see ``models.layout``)."""

    kind: str = "plain"
    """``plain`` (one HF tensor), ``qkv`` (interleaved per query group) or ``gate_up``."""
    heads_per_group: int = 1
    """Query heads per KV group (``qkv`` only)."""
    head_dim: int = 0
    """Rows per head (``qkv`` only)."""

    def __post_init__(self) -> None:
        if self.kind not in ("plain", "qkv", "gate_up"):
            raise ValueError(f"FusionLayout.kind must be plain|qkv|gate_up, got {self.kind!r}")
        if self.kind == "qkv" and self.head_dim <= 0:
            raise ValueError("FusionLayout(kind='qkv') needs head_dim > 0")

    def split(self, w: torch.Tensor) -> list[torch.Tensor]:
        """The HF components of a local weight shard, in HF order."""
        if self.kind == "gate_up":
            return list(w.chunk(2, dim=0))
        if self.kind == "qkv":
            per = (self.heads_per_group + 2) * self.head_dim
            if w.shape[0] % per:
                raise ValueError(f"linear_qkv shard has {w.shape[0]} rows, not a multiple of "
                                 f"(heads_per_group + 2) * head_dim = {per}")
            groups = w.shape[0] // per
            return list(split_qkv(w, groups * self.heads_per_group, groups, self.head_dim))
        return [w]

    def fuse(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split`."""
        if self.kind == "gate_up":
            return torch.cat(parts, dim=0)
        if self.kind == "qkv":
            q, k, v = parts
            groups = k.shape[0] // self.head_dim
            return fuse_qkv(q, k, v, groups * self.heads_per_group, groups, self.head_dim)
        return parts[0]


def _group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _shared_amax(spec: QuantSpec, parts: list[torch.Tensor], group) -> torch.Tensor | None:
    """Per-tensor amax shared by the fused members and all TP shards (two-level formats)."""
    if not spec.shares_tensor_scale:
        return None
    amax = torch.stack([p.detach().float().abs().amax() for p in parts]).amax()
    if _group_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _check_blocks(spec: QuantSpec, parts: list[torch.Tensor], parallel_dim: int, name: str) -> None:
    """Raise if a quantization block would straddle two TP shards."""
    if spec.block is None:
        return
    block = spec.block[parallel_dim]
    for part in parts:
        extent = part.shape[parallel_dim]
        if extent % block:
            what = "rows (output features)" if parallel_dim == 0 else "columns (input features)"
            raise ValueError(
                f"{spec.name}: {name} has {extent} {what} per tensor-parallel rank, not a multiple "
                f"of the {spec.name} block {spec.block}; a block would straddle two ranks and the "
                "trainer could not match the rollout. Use a tensor-parallel size that keeps "
                "whole blocks per rank, or a per-channel format (int8 / fp8)")


def _gather_cols(w: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    parts = [torch.empty_like(w) for _ in range(_group_size(group))]
    dist.all_gather(parts, w.contiguous(), group=group)
    return torch.cat(parts, dim=1), dist.get_rank(group)


def quantize_shard(spec: QuantSpec, w: torch.Tensor, layout: FusionLayout = FusionLayout(),
                   parallel_dim: int = 0, group=None, name: str = "weight",
                   finite: FiniteChecks | None = None) -> torch.Tensor:
    """``dequantize(quantize(.))`` of this rank's shard of the HF tensors (no autograd).

    ``parallel_dim``: 0 for column-parallel (output rows split), 1 for row-parallel (input
    columns split); ``group``: the tensor-parallel group the weight is split over (None: 1);
    ``finite``: where the weight's finiteness goes (the refresh's
    :class:`~megatron_qrl.quant.finite_checks.FiniteChecks`) instead of a host sync now.
    """
    w = w.detach()
    parts = layout.split(w)
    tp = _group_size(group)
    gather = tp > 1 and parallel_dim == 1 and spec.granularity == "channel"
    if tp > 1 and not gather:
        _check_blocks(spec, parts, parallel_dim, name)
    if gather:  # per-row scales need the whole row: quantize the full weight, keep our columns
        full, rank = _gather_cols(w, group)
        q = quantize_shard(spec, full, layout, 0, None, name, finite)
        return q.narrow(1, rank * w.shape[1], w.shape[1]).contiguous()
    amax = _shared_amax(spec, parts, group)
    out = [spec.quantize_dequantize(p, global_amax=amax, name=name, finite=finite)
           for p in parts]
    return layout.fuse(out)


def quantize_shards_stacked(spec: QuantSpec, weights: list[torch.Tensor],
                            layouts: list[FusionLayout], name: str = "weights",
                            finite: FiniteChecks | None = None,
                            names: list[str] | None = None) -> list[torch.Tensor] | None:
    """:func:`quantize_shard` of many unsharded weights (tensor-parallel size 1) in few calls.

    The HF components of every weight are quantized as one row-stack
    (:func:`megatron_qrl.quant.stacked.fake_quant_many`), bit-identical to one call per
    weight; a per-tensor scale (NVFP4) is given per component as the max over its weight's
    components (:func:`megatron_qrl.quant.stacked.fused_amax`), what :func:`_shared_amax`
    gives without tensor parallelism. Returns None when the stack would not be identical (a
    block straddling two components); the caller then quantizes one weight at a time.
    ``finite``: as :func:`quantize_shard`'s, every HF component of weight ``j`` recorded as
    ``names[j]`` (default: component ``i`` as ``name[i]``).
    """
    from megatron_qrl.quant.stacked import can_stack, fake_quant_many, fused_amax

    splits = [layout.split(w.detach()) for w, layout in zip(weights, layouts)]
    parts = [p for split in splits for p in split]
    if not can_stack(spec, parts):
        return None
    amax = fused_amax(parts, [len(s) for s in splits]) if spec.shares_tensor_scale else None
    part_names = None if names is None else [n for n, s in zip(names, splits) for _ in s]
    flat = iter(fake_quant_many(spec, parts, global_amax=amax, name=name, finite=finite,
                                names=part_names))
    return [layout.fuse([next(flat) for _ in split]) for split, layout in zip(splits, layouts)]


def fake_quant_stack_in_place(spec: QuantSpec, stack: torch.Tensor, layout: FusionLayout,
                              name: str = "experts", finite: FiniteChecks | None = None
                              ) -> torch.Tensor | None:
    """``Q_w`` of every expert of a stacked ``[E, out, in]`` weight (tensor-parallel size 1),
    read where its rows lie: :func:`quantize_shards_stacked` of the unbound experts then
    stacked, bit for bit, without its three copies of the stack (the components' concatenation,
    the experts' re-fusion, the stack). Quantizing the rows of ``E`` experts at once equals
    quantizing each HF component alone when no component shares a per-tensor scale (NVFP4)
    and every component spans whole blocks (``quant.stacked.can_stack``); the components of a
    ``gate_up`` / ``plain`` layout lie in the weight's own row order. None where that does not
    hold (the caller takes :func:`quantize_shards_stacked`). The torch fake quantizer runs in
    runs of whole experts of at most ``quant.stacked.MAX_STACK_ELEMENTS`` (its fp32
    temporaries); the fused one (``spec.fused_fake``: one read and one write, no temporaries)
    takes the whole stack in one kernel. ``finite``: as :func:`quantize_shard`'s (each run
    under the label errors name)."""
    from megatron_qrl.quant.stacked import MAX_STACK_ELEMENTS, can_stack

    e, n, k = stack.shape
    if (e < 2 or spec.shares_tensor_scale or layout.kind not in ("plain", "gate_up")
            or not can_stack(spec, layout.split(stack[0]) + layout.split(stack[1]))):
        return None
    w = stack.detach()
    per = e if spec.fused_fake(w.device) else max(1, MAX_STACK_ELEMENTS // max(n * k, 1))
    if per >= e:
        return spec.quantize_dequantize(w.reshape(e * n, k), name=f"{name} (stacked)",
                                        finite=finite).view(e, n, k)
    out = torch.empty_like(w)
    for s in range(0, e, per):
        rows = w[s:s + per].reshape(-1, k)
        out[s:s + per] = spec.quantize_dequantize(rows, name=f"{name}[{s}..] (stacked)",
                                                  finite=finite).view(-1, n, k)
    return out
