"""Packed (THD) micro batches: the samples of one micro batch back to back in one row.

A padded micro batch is ``[B, S]``: every row as long as the longest, the padding run through
every layer. Packed, row ``i``'s first ``lengths[i]`` tokens follow one another in one row of
``T = sum(lengths)`` tokens (plus a short tail segment when ``T`` must be a multiple of the
tensor-parallel size under sequence parallelism), and megatron-core's ``PackedSeqParams``
(``qkv_format="thd"``, ``cu_seqlens`` = the cumulative lengths, int32) tells every layer where
one sample ends: RoPE restarts at each ``cu_seqlens`` offset (``rope_utils``' thd path) and the
core attention is causal within each segment only (``TEDotProductAttention`` natively, the
local spec's ``models.sdpa_attention.SDPACoreAttention`` segment by segment). Position ids
restart at 0 per sample too (megatron's RoPE reads ``cu_seqlens``, not them).

:class:`Packing` is pure index arithmetic: :meth:`Packing.pack` gathers ``[B, S, ...]`` tensors
into the packed row ``[1, T, ...]`` and :meth:`Packing.unpack` scatters per-token values of the
packed row back to ``[B, S, ...]`` (zero where nothing was run), differentiably, so losses keep
the per-sample layout. (The same layout as slime's and Megatron-LM RL's packed batches.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Packing", "segment_bounds"]


def segment_bounds(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the non-empty segments of ``cu_seqlens`` (one host sync)."""
    cu = cu_seqlens.tolist()
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]


@dataclass(frozen=True)
class Packing:
    """Where each token of a ``[rows, width]`` micro batch sits in its packed row."""

    lengths: tuple[int, ...]
    """Tokens run of each row (its first ``lengths[i]`` positions)."""
    width: int
    """``S`` of the padded ``[rows, S]`` layout."""
    total: int
    """``T``: positions of the packed row, the tail segment included."""
    index: Tensor
    """``[sum(lengths)]`` long: flat position ``row * width + t`` of each packed token."""
    cu_seqlens: Tensor
    """``[segments + 1]`` int32 cumulative segment lengths (the tail segment last, if any)."""

    @classmethod
    def of_lengths(cls, lengths: Sequence[int], width: int, multiple: int = 1,
                   device: Any = None, at_least: int = 0) -> Packing:
        """The packing of rows ``lengths`` (each ``1 <= n <= width``) of a ``[B, width]``
        batch; ``T`` is padded up to a ``multiple`` (sequence parallelism: the tensor-parallel
        size) and to ``at_least`` (a multiple of ``multiple``: the length of the other ranks'
        packed rows, where a collective needs equal lengths) by a tail segment of its own,
        which attends only to itself and is in no loss."""
        lengths = tuple(int(n) for n in lengths)
        if not lengths or min(lengths) < 1 or max(lengths) > width:
            raise ValueError(f"Packing: row lengths {lengths} must lie in [1, {width}]")
        if multiple < 1 or at_least % multiple:
            raise ValueError(f"Packing: multiple must be >= 1 and divide at_least, got "
                             f"{multiple} and {at_least}")
        real = sum(lengths)
        tail = max(real + (-real % multiple), at_least) - real
        cu = [0]
        for n in (*lengths, *((tail,) if tail else ())):
            cu.append(cu[-1] + n)
        index = torch.cat([torch.arange(n) + i * width for i, n in enumerate(lengths)])
        return cls(lengths, width, real + tail, index.to(device),
                   torch.tensor(cu, dtype=torch.int32, device=device))

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def max_seqlen(self) -> int:
        """The longest segment (``max_seqlen_q`` / ``max_seqlen_kv``; RoPE's table length)."""
        return int(max(max(self.lengths), self.total - sum(self.lengths)))

    def pack(self, x: Tensor, fill: float | int = 0) -> Tensor:
        """``[B, width, ...]`` -> ``[1, T, ...]`` (the tail segment holds ``fill``)."""
        if tuple(x.shape[:2]) != (self.rows, self.width):
            raise ValueError(f"Packing.pack: expected [{self.rows}, {self.width}, ...], got "
                             f"{tuple(x.shape)}")
        flat = x.reshape(self.rows * self.width, *x.shape[2:])[self.index.to(x.device)]
        tail = self.total - flat.shape[0]
        if tail:
            flat = torch.cat([flat, flat.new_full((tail, *flat.shape[1:]), fill)])
        return flat.unsqueeze(0)

    def unpack(self, y: Tensor) -> Tensor:
        """``[1, T, ...]`` -> ``[B, width, ...]``, zero at positions that were not run;
        differentiable (gradients flow back to the packed positions)."""
        if y.dim() < 2 or tuple(y.shape[:2]) != (1, self.total):
            raise ValueError(f"Packing.unpack: expected [1, {self.total}, ...], got "
                             f"{tuple(y.shape)}")
        n = self.index.numel()
        out = y.new_zeros((self.rows * self.width, *y.shape[2:]))
        out = out.index_put((self.index.to(y.device),), y[0, :n])
        return out.reshape(self.rows, self.width, *y.shape[2:])

    def position_ids(self) -> Tensor:
        """``[1, T]``: 0, 1, ... restarting at every segment."""
        starts = self.cu_seqlens[:-1].long()
        seg = torch.repeat_interleave(torch.arange(starts.numel(), device=starts.device),
                                      (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long(),
                                      output_size=self.total)  # (no device sync)
        return (torch.arange(self.total, device=starts.device) - starts[seg]).unsqueeze(0)

    def seq_params(self) -> Any:
        """megatron-core ``PackedSeqParams`` (THD) of this packing."""
        from megatron.core.packed_seq_params import PackedSeqParams

        m = self.max_seqlen
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens,
                               cu_seqlens_kv=self.cu_seqlens, max_seqlen_q=m, max_seqlen_kv=m)
