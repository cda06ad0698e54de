"""The fused Triton fake quantizers (megatron_qrl/quant/triton_fake.py) give the torch
``quantize_dequantize``'s bits, run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set here before Triton loads); the aligned stacked refresh takes them
when they are selected. Compiled on a GPU: tests/gpu/test_fused_quant.py.

Run: ``PYTHONPATH=/tmp/triton_site:$PWD pytest tests/quant/test_fused_fake_quant.py``
(Triton installed aside; the shared venv has none, and there the module skips). Triton 3.7 or
later: the interpreters of 3.5 and 3.6 stop on the per-channel kernels' loop bound (``int()`` of
a one-element array, which NumPy 2.4 refuses).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.triton_cpu import require_triton_interpreter

require_triton_interpreter("tests/gpu/test_fused_quant.py")

from megatron_qrl.quant import get_spec, triton_fake, triton_quant  # noqa: E402
from megatron_qrl.quant import stacked as stacked_mod  # noqa: E402
from megatron_qrl.quant.finite_checks import FiniteChecks  # noqa: E402
from megatron_qrl.quant.fused import set_quant_impl  # noqa: E402
from megatron_qrl.utils.finite import NonFiniteError  # noqa: E402
from tests.quant.fused_cases import FORMATS, bits, fake_quant, fake_weights  # noqa: E402

if not triton_quant._SOFT:
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set; run this module alone",
                allow_module_level=True)

KERNEL = {"int8": "fake_quant_channel", "fp8": "fake_quant_channel",
          "fp8_block": "fake_quant_fp8_block", "w4a16": "fake_quant_w4a16",
          "nvfp4": "fake_quant_nvfp4"}


def assert_fake_same(fmt, w, label, global_amax=None):
    got = fake_quant(fmt, w, "triton", global_amax)
    want = fake_quant(fmt, w, "torch", global_amax)
    assert got.dtype == want.dtype == w.dtype and got.shape == want.shape, label
    diff = (bits(got) != bits(want)).sum().item()
    assert diff == 0, f"{fmt} {label}: {diff} of {w.numel()} values differ"


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_fake_quant_equals_torch(fmt):
    """fp32 / bf16 / fp16 weights: decades of magnitudes, zero and below-threshold rows,
    extreme rows, rounding ties, signed zeros, fp16 subnormal outputs, bf16 subnormal inputs,
    ragged edge blocks, zero blocks, a row-strided and a transposed weight. Mutations caught:
    ``_store_out``'s ``_bf16_rne`` dropped (the cast truncates: bf16 cases), int8 / w4a16
    codes not taken through int32 (``-0.0`` where the reference's ``0 + q * s`` gives
    ``+0.0``), the dequantization multiplier ``1 / s`` replaced by a division by ``s``, w4a16's
    scale not rounded to bf16, the stride ignored (``k`` for ``stride_w``)."""
    for label, w in fake_weights(fmt):
        assert_fake_same(fmt, w, label)


def test_nvfp4_given_tensor_amax_per_row_and_scalar():
    """nvfp4's tensor scale from a given amax (a fused group's, scalar; a stack's, per row)."""
    w = fake_weights("nvfp4")[1][1]
    for ga in (torch.tensor(3e3), torch.linspace(1.0, 5e4, w.shape[0]).reshape(-1, 1)):
        assert_fake_same("nvfp4", w, f"global_amax {tuple(ga.shape)}", ga)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_named(fmt, bad):
    """A NaN / Inf is named at once (no ``finite``), or recorded in the stream's
    :class:`FiniteChecks` (device bools, no raise) and named by its check. Mutation caught:
    the fused branch's ``_check_finite_amax`` on the kernel's tile amax dropped."""
    w = fake_weights(fmt)[3][1].clone()  # bf16
    name = "decoder.layers.3.mlp.experts.linear_fc1.weight"
    w[11, 7] = bad
    errors = []
    for impl in ("triton", "torch"):
        with pytest.raises(NonFiniteError, match=rf"^{fmt}: {re.escape(name)} has 1 non-fin"
                           ) as err:
            fake_quant(fmt, w, impl, name=name)
        errors.append(str(err.value))
    assert errors[0] == errors[1]  # the torch path's message
    finite = FiniteChecks()
    fake_quant(fmt, w, "triton", name=name, finite=finite)
    assert finite.entries and not all(bool(ok.all()) for *_, ok in finite.entries)
    with pytest.raises(NonFiniteError, match=rf"^{fmt}: {re.escape(name)} holds"):
        finite.check(get_spec(fmt))
    finite = FiniteChecks()
    fake_quant(fmt, fake_weights(fmt)[3][1], "triton", name=name, finite=finite)
    finite.check(get_spec(fmt))  # finite: no error


@pytest.mark.parametrize("fmt", ["fp8_block", "w4a16", "fp8", "int8"])
def test_stacked_refresh_takes_the_fused_kernel_in_one_call(monkeypatch, fmt):
    """``fake_quant_stack_in_place`` (the aligned experts' once-per-step refresh) runs the
    format's fused kernel once over the whole stack (no cap of runs: no fp32 temporaries) when
    it is selected, and gives the torch path's bits (which runs in capped runs here); under
    ``torch`` the kernel is not called. Mutations caught: ``quantize_dequantize`` not routed to
    the kernel (no call); the cap kept for the fused path (one call per run of experts)."""
    from megatron_qrl.te_quant.shard_quant import FusionLayout, fake_quant_stack_in_place

    calls = []
    real = getattr(triton_fake, KERNEL[fmt])

    def counting(spec, w, *args):
        calls.append(tuple(w.shape))
        return real(spec, w, *args)

    monkeypatch.setattr(triton_fake, KERNEL[fmt], counting)
    monkeypatch.setattr(stacked_mod, "MAX_STACK_ELEMENTS", 2 * 256 * 128)
    w = (torch.randn(5, 256, 128, generator=torch.Generator().manual_seed(4)) * 0.02).bfloat16()
    out = {}
    for impl in ("torch", "triton"):
        set_quant_impl(impl)
        try:
            out[impl] = fake_quant_stack_in_place(get_spec(fmt), w, FusionLayout("gate_up"),
                                                  "fc1", FiniteChecks())
        finally:
            set_quant_impl(None)
    assert calls == [(5 * 256, 128)]
    assert out["triton"].shape == w.shape and out["triton"].dtype == w.dtype
    assert torch.equal(bits(out["triton"]), bits(out["torch"]))


def _minus_as_zero_minus(self, x):
    """A unary minus as Triton before 3.8 builds it, floats included: ``0 - x`` (``+0.0`` for
    ``x = +0.0``)."""
    return self.sub(self.scalar_constant(0, x.type.scalar), x, True)


def expert_stack_in_miniature() -> tuple[torch.Tensor, list]:
    """bench/fake_quant_speed.py's fc1 stacks (``randn * 0.02`` in bf16, an outlier row every
    97 at ``x 300``) at its ``--tiny`` width: 4 experts of gate/up ``[256, 256]``, and their
    layouts."""
    from megatron_qrl.te_quant.shard_quant import FusionLayout

    w = torch.randn(4, 256, 256, generator=torch.Generator().manual_seed(0)).mul_(0.02)
    w.view(-1, 256)[::97] *= 300.0
    return w.bfloat16(), [FusionLayout("gate_up")] * 4


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "nvfp4"])
def test_negative_values_rounding_to_zero_stay_negative_zero(monkeypatch, fmt):
    """A negative value that quantizes to zero dequantizes to ``-0.0`` (the reference keeps the
    code's sign) also where Triton builds a float's unary minus as ``0 - x`` (before 3.8: the
    H200's Triton compiles ``-x`` so, and its interpreter runs it so): the edge cases, and for
    nvfp4 the miniature of a 30B-A3B fc1 stack through the stacked refresh (gate and up with
    their expert's tensor scale), ~3.4% of whose values are such zeros. Mutations caught:
    ``tl.where(y < 0, -val, val)`` for ``_signed`` in ``_nvfp4_fake_kernel`` (nvfp4: 3.4% of
    the stack, the count the H200 showed) and in ``_e4m3_soft`` (fp8, fp8_block: the
    interpreter's E4M3 values)."""
    from triton.language.semantic import TritonSemantic

    from megatron_qrl.te_quant.shard_quant import quantize_shards_stacked

    monkeypatch.setattr(TritonSemantic, "minus", _minus_as_zero_minus)
    for label, w in fake_weights(fmt)[:4]:
        assert_fake_same(fmt, w, f"{label}, unary minus 0 - x")
    if fmt != "nvfp4":
        return
    w, layouts = expert_stack_in_miniature()
    out = {}
    for impl in ("torch", "triton"):
        set_quant_impl(impl)
        try:
            out[impl] = torch.stack(quantize_shards_stacked(get_spec(fmt), list(w.unbind(0)),
                                                            layouts, "fc1"))
        finally:
            set_quant_impl(None)
    diff = (bits(out["triton"]) != bits(out["torch"])).sum().item()
    assert diff == 0, f"nvfp4 fc1 stack: {diff} of {w.numel()} values differ"
    assert ((w < 0) & (out["torch"] == 0)).float().mean().item() > 0.03
