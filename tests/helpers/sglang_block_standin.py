"""A stand-in for SGLang's block-FP8 kernel module on the CPU (SGLang is CUDA-only here).

It takes the place of ``sglang.kernels.ops.quantization.fp8_kernel`` for
:mod:`megatron_qrl.te_quant.block_gemm`, records every call in ``module.calls`` and computes
what SGLang's kernels compute, in torch: ``per_token_group_quant_fp8``:
``a = max(amax_group, 1e-10)``, ``e4m3(x * (448 / a))``, scale ``a * (1 / 448)``;
``w8a8_block_fp8_matmul_triton``: fp32 ``sum_kb (qx_kb @ qw_kb^T) * sx[:, kb] * sw[nb, kb]``
rounded once to the output dtype (DeepSeek-AI 2024, DeepSeek-V3 report sec. 3.3.2). The real
kernels against the same checks: tests/gpu/test_real_gemm.py.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from megatron_qrl.quant.numerics import FP8_E4M3_MAX, cast_e4m3
from megatron_qrl.te_quant import block_gemm


def quantize_groups(x, group_size, column_major_scales=False, **_):
    m, k = x.shape
    g = x.float().view(m, k // group_size, group_size)
    a = g.abs().amax(-1, keepdim=True).clamp_min(1e-10)
    q = cast_e4m3(g * (FP8_E4M3_MAX / a)).view(m, k)
    s = (a * (1.0 / FP8_E4M3_MAX)).view(m, k // group_size)
    return q, (s.t().contiguous().t() if column_major_scales else s)


def block_matmul(a, b, a_s, b_s, block_size, output_dtype=torch.float16):
    bn, bk = block_size
    (m, k), n = a.shape, b.shape[0]
    acc = torch.zeros(m, n)
    sw = b_s.repeat_interleave(bn, 0)[:n]  # [N, K/bk]
    for kb in range(k // bk):
        cols = slice(kb * bk, (kb + 1) * bk)
        acc += (a[:, cols].float() @ b[:, cols].float().t()) * a_s[:, kb:kb + 1] * sw[:, kb]
    return acc.to(output_dtype)


def _module() -> types.ModuleType:
    mod = types.ModuleType(block_gemm.MODULES[0])
    mod.calls = []

    def quant(x, group_size, **kw):
        mod.calls.append(("quant", x, group_size, kw))
        return quantize_groups(x, group_size, **kw)

    def matmul(a, b, a_s, b_s, block_size, output_dtype=torch.float16):
        mod.calls.append(("gemm", a, b, a_s, b_s, list(block_size), output_dtype))
        return block_matmul(a, b, a_s, b_s, block_size, output_dtype)

    mod.per_token_group_quant_fp8, mod.w8a8_block_fp8_matmul_triton = quant, matmul
    return mod


@contextmanager
def sglang_standin() -> Iterator[types.ModuleType]:
    """The stand-in module, found by ``block_gemm``'s import inside the block."""
    mod = _module()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, block_gemm.MODULES[0], mod)
        block_gemm._load.cache_clear()
        try:
            yield mod
        finally:
            block_gemm._load.cache_clear()
