"""One grouped GEMM over all local experts: ``y[rows of e] = x[rows of e] @ W_e^T`` for every e.

The experts' token groups lie back to back in ``x`` (megatron's permuted order, sizes
``counts``); ``w`` is the stacked ``[num_experts, out, in]`` weight. Two loop-free
implementations of the same maths (Shazeer et al. 2017's expert layer; the segment / grouped
GEMM of Gale et al. 2023, "MegaBlocks", eq. 1):

- ``torch._grouped_mm`` where torch has it for these operands: on CUDA the CUTLASS grouped GEMM
  (BF16, the kernel's documented case), on the CPU torch's own grouped kernel (fp32: the same
  products as one ``matmul`` per expert, bit for bit); rows 16-byte aligned;
- otherwise a padded batched GEMM: every group is scattered into a ``[num_experts, max_rows,
  in]`` buffer (zeros elsewhere), one ``torch.bmm`` multiplies all experts, and the rows are
  gathered back. Padding rows are zeros, so they add nothing to the weight gradient.

Both are differentiable through autograd (inputs and the stacked weight). Used by the stacked
experts (:mod:`megatron_qrl.models.stacked_experts`) and the aligned grouped linears
(:mod:`megatron_qrl.te_quant.te_grouped`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

_CPU_GROUPED = (torch.float32,)


def _use_torch_grouped(x: torch.Tensor, w: torch.Tensor) -> bool:
    """``torch._grouped_mm`` takes these operands (dtype, device, 16-byte aligned rows)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or x.shape[0] == 0:
        return False
    if x.dtype not in ((torch.bfloat16,) if x.is_cuda else _CPU_GROUPED):
        return False
    size = x.element_size()
    return (x.shape[-1] * size) % 16 == 0 and (w.shape[1] * size) % 16 == 0


def padded_index(counts: Sequence[int], tokens: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert, pos)`` of each of the ``tokens`` grouped rows in the padded ``[experts,
    max(counts), ...]`` layout of the padded-``bmm`` grouped GEMM."""
    sizes = torch.tensor(list(counts), device=device, dtype=torch.long)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes,
                                     output_size=tokens)
    start = torch.cumsum(sizes, 0) - sizes
    return expert, torch.arange(tokens, device=device) - start[expert]


def padded_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """The padded-``bmm`` grouped GEMM (module docstring); ``x`` ``[sum(counts), in]``."""
    expert, pos = padded_index(counts, x.shape[0], x.device)
    padded = x.new_zeros(len(counts), max(counts, default=0), x.shape[1]).index_put((expert, pos), x)
    return torch.bmm(padded, w.transpose(1, 2))[expert, pos]


def group_offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """The groups' cumulative ends as int32 on ``device`` (``offs`` of torch's grouped GEMMs),
    copied from pinned memory on CUDA: the copy is queued like a kernel, where one from
    pageable memory may wait for the stream's earlier work."""
    ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32,
                        pin_memory=device.type == "cuda")
    return ends.to(device, non_blocking=True)


def torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``torch._grouped_mm`` with ``offs`` = the groups' cumulative ends (module docstring)."""
    y = torch._grouped_mm(x.contiguous(), w.contiguous().transpose(1, 2),
                          offs=group_offsets(counts, x.device))
    if y.requires_grad:  # its backward needs a dense gradient (a broadcast one has stride 0)
        y.register_hook(torch.Tensor.contiguous)
    return y


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``cat_e(x_e @ w[e]^T)`` for the row groups ``x_e`` of sizes ``counts`` (one GEMM call)."""
    counts = [int(c) for c in counts]
    if w.dim() != 3 or w.shape[0] != len(counts) or w.shape[2] != x.shape[-1]:
        raise ValueError(f"grouped_mm: weight {tuple(w.shape)} is not [{len(counts)} experts, "
                         f"out, {x.shape[-1]}]")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: the groups hold {sum(counts)} rows, the input "
                         f"{x.shape[0]}")
    if _use_torch_grouped(x, w):
        return torch_grouped_mm(x, w, counts)
    return padded_grouped_mm(x, w, counts)
