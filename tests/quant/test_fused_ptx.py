"""The fused quantizers compiled for sm_90 (Hopper) without a GPU keep the reference's
rounding: no fused multiply-add (an unrounded product would move rounding ties), IEEE
division (``div.rn``, not ``div.full`` / ``rcp.approx``), the round-to-nearest-even
saturating E4M3 cast and round-to-nearest bf16 cast. Needs Triton (skipped in CPU CI);
compiled in a fresh process by tests/quant/fused_ptx.py. The same for the real GEMM's
operand kernels (per-token activation quantization, per-row dequantization)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.triton_cpu import run_ptx_script

if importlib.util.find_spec("triton") is None:  # not imported here: the interpreter test's
    pytest.skip("triton not installed (CPU CI): GPU test tests/gpu/test_fused_quant.py covers it",
                allow_module_level=True)


@pytest.fixture(scope="module")
def ptx():
    return run_ptx_script("tests/quant/fused_ptx.py")


def test_no_fma_and_ieee_division(ptx):
    for name, ops in ptx.items():
        bad = {op: n for op, n in ops.items()
               if op.startswith(("fma.", "rcp.", "div.full", "div.approx"))}
        assert not bad, f"{name}: {bad}"
        if not name.startswith("dequant"):  # the dequantization divides nothing
            assert ops.get("div.rn.f32", 0) > 0, f"{name}: no IEEE division in {ops}"


def test_native_round_to_nearest_casts(ptx):
    for name in ("fp8", "fp8_block", "fp8_block_into", "nvfp4", "act_fp8"):
        assert ptx[name].get("cvt.rn.satfinite.e4m3x2.f32", 0) > 0, (name, ptx[name])
    for name in ("w4a16", "dequant_fp8", "dequant_int8"):
        assert any(op.startswith("cvt.rn.bf16") for op in ptx[name]), (name, ptx[name])
