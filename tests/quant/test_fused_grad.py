"""The FP8 backward's fused gradient quantizers (megatron_qrl/quant/triton_grad.py) give the torch
reference's bits (``fp8_backward.quantize_grad_rows`` of the folded fp32 gradient), run by
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before Triton loads), and
through them the real linear's FP8 input and weight gradients. The compiled kernels' proof:
tests/gpu/test_fused_quant.py.

Run: ``PYTHONPATH=/tmp/triton_site:$PWD TRITON_INTERPRET=1 pytest tests/quant/test_fused_grad.py``
(Triton installed aside; the shared venv has none, and there the module skips).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.triton_cpu import require_triton_interpreter

require_triton_interpreter("tests/gpu/test_fused_quant.py")

from megatron_qrl.quant import triton_grad, triton_quant  # noqa: E402
from megatron_qrl.quant.fused import set_quant_impl  # noqa: E402
from megatron_qrl.te_quant import fp8_backward as fb  # noqa: E402
from tests.quant.fused_cases import assert_bits_equal, grad_cases  # noqa: E402

if not triton_quant._SOFT:
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set; run this module alone",
                allow_module_level=True)


def _reference(folded: torch.Tensor, cuda_div: bool):
    """``fb.quantize_grad_rows`` with the scale computed as CUDA torch computes ``amax / 448``
    (``amax * fl(1 / 448)``) where ``cuda_div``."""
    if not cuda_div:
        return fb.quantize_grad_rows(folded, "e4m3")
    amax = torch.linalg.vector_norm(folded, ord=float("inf"), dim=-1, keepdim=True)
    scale = amax * float(np.float32(1.0) / np.float32(448.0))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (folded / scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("cuda_div", [False, True])
def test_dgrad_operand_equals_the_reference(cuda_div):
    """``Q_row(g * sw^T)``. Mutations caught: the quotient as ``v * (1 / s)`` (codes at the
    rounding ties), the zero row's scale left 0 (``where(s > 0)`` dropped), the fold applied
    after the amax, ``cuda_div`` ignored (the True case)."""
    for label, g, sw, _ in grad_cases():
        codes, scale = triton_grad.quantize_grad_rows(g, sw, cuda_div=cuda_div)
        rq, rs = _reference(fb.folded_grad(g, sw), cuda_div)
        assert_bits_equal(codes, rq, f"{label} codes")
        assert_bits_equal(scale, rs, f"{label} scale")


@pytest.mark.parametrize("cuda_div", [False, True])
def test_wgrad_operand_equals_the_reference(cuda_div):
    """``Q_col(g * sx)`` written transposed ``[N, M]``. Mutations caught: the codes stored
    untransposed, one column's amax taken over one tile of tokens only (no merge across the
    token tiles), the NaN flag left out (a NaN column's scale NaN instead of 1)."""
    for label, g, _, sx in grad_cases():
        codes, scale = triton_grad.quantize_grad_cols_t(g, sx, cuda_div=cuda_div)
        rq, rs = _reference(fb.folded_grad_t(g, sx), cuda_div)
        assert_bits_equal(codes, rq, f"{label} codes")
        assert_bits_equal(scale, rs, f"{label} scale")


def test_grouped_dgrad_operand_takes_each_rows_expert():
    """Stacked experts: each row folds its own expert's scales. Mutation caught: every row
    takes expert 0's (``wrow`` without the group index)."""
    _, g, _, _ = grad_cases()[0]
    gen = torch.Generator().manual_seed(5)
    counts = [30, 0, g.shape[0] - 30]
    sw = torch.rand(3, g.shape[1], generator=gen) * 1e-2 + 1e-4
    group = torch.arange(3).repeat_interleave(torch.tensor(counts))
    codes, scale = triton_grad.quantize_grad_rows(g, sw, group)
    rq, rs = fb.quantize_grad_rows(g.float() * sw[group], "e4m3")
    assert_bits_equal(codes, rq, "grouped codes")
    assert_bits_equal(scale, rs, "grouped scale")


def test_fp8_backward_through_the_kernels_equals_torch():
    """The real linear (dense and grouped experts) with the FP8 dgrad and wgrad: gradients bit
    for bit the same through the fused gradient quantizers as through the torch code, and the
    kernels are the ones taken. Mutation caught: ``grad_kernels`` returning None (the counter
    stays 0)."""
    from tests.quant.fused_cases import fp8_backward_through_real_linear

    calls = fp8_backward_through_real_linear("cpu")
    assert calls["quantize_grad_rows"] >= 2 and calls["quantize_grad_cols_t"] >= 2, calls


def test_e5m2_keeps_the_torch_code():
    """The kernels write E4M3: an E5M2 gradient is not routed to them."""
    set_quant_impl("triton")
    try:
        assert fb.grad_kernels(torch.device("cpu"), "e5m2") is None
        assert fb.grad_kernels(torch.device("cpu"), "e4m3") is triton_grad
    finally:
        set_quant_impl(None)
