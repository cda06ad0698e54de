"""The rollout's codes and scales of an aligned module's cached ``Q_w(W)``, one per HF tensor.

The aligned forward (QaRL, Fan et al. 2025) caches ``Q_w(W)`` once per optimizer step: the
real GEMM caches the codes and per-channel scales (:class:`~.real_gemm.RealWeight`), the fake
GEMM the dequantized weight and, where the state keeps them
(:attr:`~.state.AlignedForwardState.keep_codes`), the codes of each HF component beside it.
The weight sync packs those codes instead of quantizing the weights a second time. The
functions here turn a cache entry of one unsharded Megatron weight (fused ``qkv`` /
``gate_up`` included) into one :class:`~megatron_qrl.quant.QuantizedWeight` per HF tensor,
in HF order, equal bit for bit to ``spec.quantize_weight`` of that HF tensor (the fused
group's shared amax for two-level formats, as :func:`~.shard_quant.quantize_shard` gives it).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_qrl.quant import QuantizedWeight, QuantSpec
from megatron_qrl.quant.finite_checks import FiniteChecks
from megatron_qrl.quant.stacked import fused_amax, quantize_many
from megatron_qrl.te_quant.real_gemm import RealWeight
from megatron_qrl.te_quant.shard_quant import FusionLayout


def component_codes(spec: QuantSpec, weights: list[torch.Tensor], layout: FusionLayout,
                    name: str = "weight", finite: FiniteChecks | None = None
                    ) -> list[list[QuantizedWeight]]:
    """``spec.quantize_weight`` of each HF component of each unsharded weight (the
    quantization :func:`~.shard_quant.quantize_shard` dequantizes, kept as codes), in few
    stacked quantizer calls where bit-identical (:func:`~megatron_qrl.quant.stacked.
    quantize_many`); each result owns its storage. ``finite``: as ``quantize_many``'s."""
    splits = [layout.split(w.detach()) for w in weights]
    parts = [p for split in splits for p in split]
    amax = fused_amax(parts, [len(s) for s in splits]) if spec.shares_tensor_scale else None
    flat = iter(quantize_many(spec, parts, global_amax=amax, name=name, finite=finite))
    return [[_owned(next(flat)) for _ in split] for split in splits]


def _owned(q: QuantizedWeight) -> QuantizedWeight:
    """``q`` with every tensor owning its storage (a split of a stacked quantization holds
    views of the stack)."""
    return dataclasses.replace(q, **{f: _own(getattr(q, f)) for f in _TENSORS
                                    if getattr(q, f) is not None})


_TENSORS = ("codes", "scale", "global_scale", "packed")


def fused_dequantized(spec: QuantSpec, codes: list[QuantizedWeight], layout: FusionLayout
                      ) -> torch.Tensor:
    """The fake GEMM's cached weight from :func:`component_codes`: ``quantize_shard``'s value
    bit for bit (``dequantize(quantize_weight(w)) == quantize_dequantize(w)``, the spec's
    contract)."""
    return layout.fuse([spec.dequantize(q) for q in codes])


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it owns its storage, else a compact copy (a pickled view of a fused or stacked
    cache entry would carry the whole entry over the wire); 1-byte floats are copied as bytes
    (CPU float8 lacks the copy kernels)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    if t.dtype.is_floating_point and t.element_size() == 1:
        return _own(t.view(torch.uint8)).view(t.dtype)
    return t.clone(memory_format=torch.contiguous_format)


def _split_rows(t: torch.Tensor, layout: FusionLayout) -> list[torch.Tensor]:
    """``layout.split`` of a per-row tensor (codes ``[N, K]`` or scales ``[N, 1]``) as tensors
    owning their storage; 1-byte floats are split as bytes (CPU float8 lacks the copy
    kernels)."""
    raw = t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t
    return [_own(p).view(t.dtype) for p in layout.split(raw)]


def real_codes(spec: QuantSpec, qw: RealWeight, layout: FusionLayout, dtype: torch.dtype
               ) -> list[QuantizedWeight]:
    """The real GEMM's cached operand of one weight, split into its HF components.

    Per-channel scales are row-local, so the rows of the fused weight's quantization are the
    quantization of each component (what the engine quantizes separately); 128-row block
    scales split the same way in units of a block (every fused segment spans whole blocks,
    :func:`~.real_gemm.check_block_layout`)."""
    scale_layout = layout
    if spec.granularity == "block" and layout.kind == "qkv":
        scale_layout = dataclasses.replace(layout, head_dim=layout.head_dim // spec.block[0])
    out = []
    for codes, scale in zip(_split_rows(qw.codes, layout), _split_rows(qw.scale, scale_layout)):
        out.append(QuantizedWeight(spec.name, codes, scale, None, tuple(codes.shape), dtype))
    return out
