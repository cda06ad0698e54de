"""The fused operand kernels of the real low-bit GEMM (megatron_qrl/quant/triton_act.py) give
the torch reference's bits, run by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``,
set here before Triton loads): per-token activation codes and scales
(``QuantSpec.quantize_activation``) and the per-row dequantization of the straight-through
backward (``QuantSpec.dequantize_rows``), and through them the real linear's forward and
gradients. The compiled kernels' proof: tests/gpu/test_fused_quant.py.

Run: ``PYTHONPATH=/tmp/triton_site:$PWD TRITON_INTERPRET=1 pytest tests/quant/test_fused_act.py``
(Triton installed aside; the shared venv has none, and there the module skips).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.triton_cpu import require_triton_interpreter

require_triton_interpreter("tests/gpu/test_fused_quant.py")

from megatron_qrl.quant import get_spec, triton_act, triton_quant  # noqa: E402
from megatron_qrl.quant.fused import set_quant_impl  # noqa: E402
from megatron_qrl.quant.numerics import cast_e4m3  # noqa: E402
from tests.quant.fused_cases import (  # noqa: E402
    act_through_real_linear,
    activations,
    assert_bits_equal,
    bits,
    dequant_cases,
    fake_act,
    group_activations,
    group_reference,
    quantize_act,
)

if not triton_quant._SOFT:
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set; run this module alone",
                allow_module_level=True)

FORMATS = ("fp8", "int8")


@pytest.mark.parametrize("fmt", FORMATS)
def test_activation_codes_and_scales_equal_the_reference(fmt):
    """Mutations caught: ``s = a * fl(1 / MAX)`` on the CPU (the CUDA numerics), round half to
    even instead of half away (int8), no 1e-10 floor (int8's zero token), NaN left out of the
    amax (fp8's NaN token)."""
    for label, x in activations(fmt):
        (cq, cs), (rq, rs) = quantize_act(fmt, x, "triton"), quantize_act(fmt, x, "torch")
        assert_bits_equal(cq, rq, f"{fmt} {label} codes")
        assert_bits_equal(cs, rs, f"{fmt} {label} scale")


@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_quant_activation_through_the_kernels(fmt):
    """The fake path's activation (quantize, then dequantize to the input's dtype) is the same
    bits through the kernels as through torch."""
    spec = get_spec(fmt)
    for label, x in activations(fmt):
        out = {}
        for impl in ("torch", "triton"):
            set_quant_impl(impl)
            try:
                out[impl] = spec.fake_quant_activation(x)
            finally:
                set_quant_impl(None)
        want = spec._act(x.float()).to(x.dtype)
        assert_bits_equal(out["torch"], want, f"{fmt} {label} torch")
        assert_bits_equal(out["triton"], want, f"{fmt} {label} triton")


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_division_branch(fmt):
    """On CUDA torch divides by a Python scalar as ``a * fl(1 / MAX)``: the kernel's CUDA
    branch gives that scale (and the codes from it), and it is not the CPU's on every token
    (so the device switch matters)."""
    maxv = 127.0 if fmt == "int8" else 448.0
    spec = get_spec(fmt)
    x = activations(fmt)[0][1]
    q, s = triton_act.quantize_act_per_token(spec, x, cuda_div=True)
    a = x.float().abs().amax(-1, keepdim=True)
    if fmt == "int8":
        a = a.clamp(min=1e-10)
    want = a * torch.tensor(np.float32(1.0) / np.float32(maxv))
    assert_bits_equal(s, want, f"{fmt} CUDA scale")
    if fmt == "fp8":
        inv = torch.where(want == 0, 0.0, 1.0 / torch.where(want == 0, 1.0, want))
        assert_bits_equal(q, cast_e4m3(x.float() * inv), "fp8 CUDA codes")
    _, cpu = quantize_act(fmt, x, "torch")
    assert (bits(cpu) != bits(s)).any(), "the two divisions agree on every token here"
    assert not triton_act.torch_divides_by_reciprocal("cpu", maxv)  # the CPU divides


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_rows_equals_the_reference(dtype):
    """Mutations caught: the scale of the wrong row (``scale[row // 2]``), a
    truncating bf16 cast, subnormal E4M3 codes decoded as normals."""
    for label, codes, scale in dequant_cases():
        spec = get_spec("int8" if codes.dtype == torch.int8 else "fp8")
        set_quant_impl("triton")
        try:
            fused = spec.dequantize_rows(codes, scale, dtype)
        finally:
            set_quant_impl(None)
        assert_bits_equal(fused, (codes.float() * scale).to(dtype), f"{label} -> {dtype}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_real_linear_forward_and_gradients_through_the_kernels(fmt):
    """The real linear (forced on the CPU) with the fused operands equals the torch operands'
    output and gradients bit for bit, dense and grouped."""
    act_through_real_linear(fmt, "cpu")


def test_activation_groups_equal_the_reference():
    """fp8_block's 1x128 groups in one kernel: codes and scales as the torch reference.
    Mutations caught: the floor left out (a zero group's codes NaN), the scale as a division
    ``a / 448`` (the CPU's IEEE division differs from the reference's multiply), the
    multiplier ``448 / a`` divided directly instead of ``reciprocal(a) * 448``, the amax over
    the token instead of the group."""
    spec = get_spec("fp8_block")
    for label, x in group_activations():
        q, s = triton_act.quantize_act_per_token_group(spec, x)
        rq, rs = group_reference(x)
        assert_bits_equal(q, rq, f"{label} codes")
        assert_bits_equal(s, rs, f"{label} scale")


def test_fake_quant_activation_groups_through_the_kernels():
    """fp8_block's fake-path activation (the aligned experts' input) is the same bits through
    the group kernel + the row dequantization as through ``_act``; an input width that is not
    a multiple of 128 is refused in one line on both paths."""
    spec = get_spec("fp8_block")
    for label, x in group_activations():
        assert_bits_equal(fake_act(spec, x, "triton"), spec._act(x.float()).to(x.dtype), label)
    for impl in ("torch", "triton"):
        set_quant_impl(impl)
        try:
            with pytest.raises(ValueError, match="not a multiple"):
                spec.fake_quant_activation(torch.ones(2, 200))
        finally:
            set_quant_impl(None)
