"""Quantize many weights of one shape in one call, bit for bit as if one at a time.

A Qwen3-30B-A3B sync quantizes 48 x 128 x 3 expert tensors and the aligned forward re-quantizes
the same after every optimizer step. Quantized one by one, each is a dozen small kernels and
one device sync (the finiteness check); the count, not the bytes, sets the time on a GPU.

Row-concatenating ``[W_1; ...; W_n]`` and quantizing once gives exactly the rows each ``W_i``
would get alone when no scale spans two weights:

- per-channel formats (``int8``, ``fp8``): one scale per row;
- group formats (``w4a16``, groups of 128 along the input): one scale per row and group;
- block formats (``fp8_block``): when every weight's row count is a multiple of the block's rows
  (128), so that no block straddles two weights (partial edge blocks are zero-padded alone);
- never for formats with a per-tensor scale (``nvfp4``'s ``weight_scale_2``): the amax of the
  stack is not each weight's amax. Those are quantized one at a time.

The result is split back along the rows; :func:`quantize_many` and :func:`fake_quant_many`
fall back to the one-at-a-time loop whenever :func:`can_stack` says no. Tests hold both to the
single-weight reference for every format.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .spec import QuantizedWeight, QuantSpec

MAX_STACK_ELEMENTS = 1 << 27
"""Largest stack quantized in one call (elements; fp32 temporaries are ~3x its bytes)."""


def can_stack(spec: QuantSpec, weights: Sequence[torch.Tensor]) -> bool:
    """True if quantizing the row-concatenation of ``weights`` equals quantizing each alone."""
    if not spec.quantizes_weights or spec.shares_tensor_scale or len(weights) < 2:
        return False
    first = weights[0]
    if any(w.dim() != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype
           or w.device != first.device for w in weights):
        return False
    rows = spec.block[0] if spec.block is not None else 1
    return all(w.shape[0] % rows == 0 for w in weights)


def _chunks(weights: Sequence[torch.Tensor], limit: int) -> list[list[int]]:
    """Indices of ``weights`` grouped into runs of at most ``limit`` elements (at least one)."""
    out: list[list[int]] = []
    size = 0
    for i, w in enumerate(weights):
        if out and size + w.numel() <= limit:
            out[-1].append(i)
            size += w.numel()
        else:
            out.append([i])
            size = w.numel()
    return out


def _split(spec: QuantSpec, q: QuantizedWeight, rows: list[int]) -> list[QuantizedWeight]:
    """Split a stacked :class:`QuantizedWeight` back into one per weight (views, no copies)."""
    per_scale_row = spec.block[0] if spec.block is not None else 1
    codes = torch.split(q.codes, rows, dim=0)
    scales = torch.split(q.scale, [r // per_scale_row for r in rows], dim=0)
    return [QuantizedWeight(q.spec, c, s, None, (r, q.shape[1]), q.dtype)
            for c, s, r in zip(codes, scales, rows)]


def _stacks(weights: Sequence[torch.Tensor], name: str, max_elements: int
            ) -> Iterator[tuple[torch.Tensor, list[int], str]]:
    """(row-concatenation, row counts, label for errors) per run of at most ``max_elements``."""
    for idx in _chunks(weights, max_elements):
        part = [weights[i].detach() for i in idx]
        stacked = part[0] if len(part) == 1 else torch.cat(part, dim=0)
        label = f"{name}[{idx[0]}..{idx[-1]}] (stacked)" if len(idx) > 1 else f"{name}[{idx[0]}]"
        yield stacked, [w.shape[0] for w in part], label


def quantize_many(spec: QuantSpec, weights: Sequence[torch.Tensor], *, name: str = "weights",
                  max_elements: int = MAX_STACK_ELEMENTS) -> list[QuantizedWeight]:
    """``[spec.quantize_weight(w) for w in weights]``, stacked where that is bit-identical.

    ``name`` names the group in errors (a non-finite value, a shape the format cannot take).
    """
    if not can_stack(spec, weights):
        return [spec.quantize_weight(w, name=f"{name}[{i}]") for i, w in enumerate(weights)]
    out: list[QuantizedWeight] = []
    for stacked, rows, label in _stacks(weights, name, max_elements):
        out.extend(_split(spec, spec.quantize_weight(stacked, name=label), rows))
    return out


def fake_quant_many(spec: QuantSpec, weights: Sequence[torch.Tensor], *, name: str = "weights",
                    max_elements: int = MAX_STACK_ELEMENTS) -> list[torch.Tensor]:
    """``[spec.dequantize(spec.quantize_weight(w)) for w in weights]`` (no autograd), stacked
    where that is bit-identical; each result has its weight's dtype."""
    if not can_stack(spec, weights):
        return [spec.dequantize(q, dtype=w.dtype)
                for q, w in zip(quantize_many(spec, weights, name=name), weights)]
    out: list[torch.Tensor] = []
    for stacked, rows, label in _stacks(weights, name, max_elements):
        deq = spec.dequantize(spec.quantize_weight(stacked, name=label), dtype=stacked.dtype)
        out.extend(torch.split(deq, rows, dim=0))
    return out
