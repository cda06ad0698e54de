"""The fused kernels' E4M3 cast alone, for the tests (imports Triton: only where it is
installed; tests/quant/test_fused_quant.py, tests/gpu/test_fused_quant.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_qrl.quant import triton_quant


@triton.jit
def _cast(x_ptr, out_ptr, n, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    code, _ = triton_quant._e4m3(tl.load(x_ptr + i, mask=i < n, other=0.0), SOFT)
    tl.store(out_ptr + i, code, mask=i < n)


def e4m3_codes(x: torch.Tensor, soft: bool) -> torch.Tensor:
    """:func:`triton_quant._e4m3` of 1-D fp32 ``x`` (|x| <= 448) as bytes: ``soft`` the
    interpreter's bit arithmetic, else the compiled native cast."""
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _cast[(1,)](x, out, x.numel(), SOFT=soft, BLOCK=triton.next_power_of_2(x.numel()))
    return out
