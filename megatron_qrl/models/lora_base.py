"""Frozen base storage of a LoRA linear: bf16, NF4 (QLoRA) or a rollout QuantSpec's codes.

``--qrl-lora-base-format``:

- ``bf16``: the base as it was (the trainer's parameter dtype), a buffer.
- ``nf4``: QLoRA's NF4 + double-quantized absmax (:mod:`megatron_qrl.quant.nf4`) of this
  rank's shard; a trainer-storage format (no SGLang packing): the engine gets the dequantized
  base.
- a rollout format (``int8``, ``fp8``, ``fp8_block``, ``w4a16``, ``nvfp4``): each HF
  projection of the shard (q/k/v, gate/up split as in ``models.layout``) quantized by
  ``QuantSpec.quantize_weight`` exactly as the rollout quantizes the full HF tensor (NVFP4's
  per-tensor scale shared by the fused group and over TP, as SGLang fuses them); codes
  (4-bit ones two per byte) + scales. ``dequantize`` then equals the rollout engine's weight,
  bit for bit — the aligned forward for the frozen base (QaRL). Not exact, so refused: a
  per-output-channel format on a row-parallel weight split over TP (the row's scale spans
  ranks), and a block that straddles two TP shards.

All buffers are persistent: a checkpoint holds the frozen base ("the base reference").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.nf4 import NF4Weight, nf4_dequantize, nf4_quantize
from megatron_qrl.quant.numerics import pack_nibbles, unpack_nibbles
from megatron_qrl.quant.spec import QuantizedWeight

__all__ = ["CodesBase", "NF4Base", "PlainBase", "make_base_storage", "split_parts", "fuse_parts"]


class PlainBase(torch.nn.Module):
    """The base weight unchanged (``bf16``: the parameter dtype)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().clone())

    def dequantize(self) -> torch.Tensor:
        return self.weight


class NF4Base(torch.nn.Module):
    """NF4 codes + double-quantized absmax of the shard (QLoRA)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q = nf4_quantize(weight)
        for k, v in q.tensors().items():
            self.register_buffer(k, v)
        self.shape, self.dtype = q.shape, q.dtype

    def dequantize(self) -> torch.Tensor:
        return nf4_dequantize(NF4Weight(self.codes, self.absmax_q, self.absmax_scale,
                                        self.absmax_mean, self.shape, self.dtype))


def split_parts(w: torch.Tensor, setup: Any) -> list[torch.Tensor]:
    """The HF projections of a local (fused) shard (``LoraSetup.kind``)."""
    if setup.kind == "gate_up":
        return list(w.chunk(2, dim=0))
    if setup.kind == "qkv":
        per = (setup.heads_per_group + 2) * setup.head_dim
        g = w.reshape(w.shape[0] // per, per, w.shape[1])
        q, k, v = torch.split(g, [setup.heads_per_group * setup.head_dim, setup.head_dim,
                                  setup.head_dim], dim=1)
        return [t.reshape(-1, w.shape[1]) for t in (q, k, v)]
    return [w]


def fuse_parts(parts: list[torch.Tensor], setup: Any) -> torch.Tensor:
    """Inverse of :func:`split_parts`."""
    if setup.kind == "qkv":
        q, k, v = parts
        groups, cols = k.shape[0] // setup.head_dim, q.shape[1]
        return torch.cat([t.reshape(groups, -1, cols) for t in (q, k, v)], dim=1).reshape(-1, cols)
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


class CodesBase(torch.nn.Module):
    """A rollout format's codes + scales per HF projection of the shard."""

    def __init__(self, spec_name: str, parts: list[QuantizedWeight], setup: Any) -> None:
        super().__init__()
        self.spec_name, self.setup = spec_name, setup
        self.meta = []
        for i, q in enumerate(parts):
            four_bit = get_spec(spec_name).weight_format in ("int4", "e2m1")
            codes = pack_nibbles(q.codes) if four_bit else q.codes
            self.register_buffer(f"codes{i}", codes)
            self.register_buffer(f"scale{i}", q.scale)
            self.register_buffer(f"gscale{i}", q.global_scale)
            self.meta.append((four_bit, q.codes.dtype, q.shape, q.dtype))

    def dequantize(self) -> torch.Tensor:
        spec = get_spec(self.spec_name)
        out = []
        for i, (four_bit, cdtype, shape, dtype) in enumerate(self.meta):
            codes = getattr(self, f"codes{i}")
            if four_bit:
                codes = unpack_nibbles(codes)
                codes = ((codes.to(torch.int16) ^ 8) - 8).to(cdtype) if cdtype == torch.int8 \
                    else codes.to(cdtype)
            q = QuantizedWeight(self.spec_name, codes, getattr(self, f"scale{i}"),
                                getattr(self, f"gscale{i}"), shape, dtype)
            out.append(spec.dequantize(q))
        return fuse_parts(out, self.setup)


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _check_exact(spec: Any, parts: list[torch.Tensor], dim: int, tp: int, where: str) -> None:
    if tp == 1:
        return
    if dim == 1 and spec.granularity == "channel":
        raise ValueError(
            f"--qrl-lora-base-format {spec.name}: {where} is row-parallel over {tp} ranks and "
            f"{spec.name} has one scale per output row, which spans the ranks; the trainer's "
            "base could not equal the rollout's. Use --tensor-model-parallel-size 1 or a "
            "block format (fp8_block, w4a16, nvfp4)")
    if spec.block is not None:
        for p in parts:
            if p.shape[dim] % spec.block[dim]:
                raise ValueError(
                    f"--qrl-lora-base-format {spec.name}: {where} has {p.shape[dim]} "
                    f"{'rows' if dim == 0 else 'columns'} per tensor-parallel rank, not a multiple "
                    f"of the block {spec.block}; use a tensor-parallel size keeping whole blocks")


def codes_base(spec_name: str, linear: Any, where: str) -> CodesBase:
    """:class:`CodesBase` of ``linear``'s weight (shared per-tensor amax over the fused group
    and over TP, as ``te_quant.shard_quant.quantize_shard`` does)."""
    spec = get_spec(spec_name)
    w = linear.weight.detach()
    setup = linear.qrl_lora
    parts = split_parts(w, setup)
    group = getattr(linear, "tp_group", None)
    _check_exact(spec, parts, linear._qrl_parallel_dim, _group_size(group), where)
    amax = None
    if spec.shares_tensor_scale:
        amax = torch.stack([p.float().abs().amax() for p in parts]).amax()
        if _group_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    qs = [spec.quantize_weight(p.contiguous(), global_amax=amax, name=where) for p in parts]
    return CodesBase(spec_name, qs, setup)


def make_base_storage(base_format: str) -> Any:
    """``make_storage(name, linear)`` for :func:`megatron_qrl.models.lora.freeze_base`."""
    def make(name: str, linear: Any) -> torch.nn.Module:
        w = linear.weight.detach()
        if base_format == "bf16" or not get_spec_or_none(base_format):
            return NF4Base(w) if base_format == "nf4" else PlainBase(w)
        return codes_base(base_format, linear, name)

    return make


def get_spec_or_none(name: str) -> Any:
    try:
        spec = get_spec(name)
    except ValueError:
        return None
    return spec if spec.quantizes_weights else None


def storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of all frozen base storages in ``module`` (codes + scales)."""
    total = 0
    for m in module.modules():
        if isinstance(m, (PlainBase, NF4Base, CodesBase)):
            total += sum(b.numel() * b.element_size() for b in m.buffers() if b is not None)
    return total
