"""The fused log-prob kernels compiled for sm_90 (Hopper) without a GPU: both compile (the
interpreter tests cannot see compile-only errors), their row offsets are 64-bit (``[16384,
151936]`` logits have more than 2^31 elements), and they read and write the BF16 logits in
128-bit vectors. Needs Triton (skipped in CPU CI); compiled in a fresh process by
tests/losses/logprob_ptx.py."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.triton_cpu import run_ptx_script

if importlib.util.find_spec("triton") is None:  # not imported here: the interpreter test's
    pytest.skip("triton not installed (CPU CI): GPU test tests/gpu/test_logprob_kernel.py "
                "covers it", allow_module_level=True)


@pytest.fixture(scope="module")
def ptx():
    return run_ptx_script("tests/losses/logprob_ptx.py")


def test_row_offsets_are_64_bit(ptx):
    for name, ops in ptx.items():
        assert ops.get("mul.lo.s64", 0) > 0, f"{name}: no 64-bit row offset in {ops}"


def test_logits_move_in_128_bit_vectors(ptx):
    assert ptx["row_stats"].get("ld.global.v4.b32", 0) > 0, ptx["row_stats"]
    assert ptx["grad_logits"].get("ld.global.v4.b32", 0) > 0, ptx["grad_logits"]
    assert ptx["grad_logits"].get("st.global.v4.b32", 0) > 0, ptx["grad_logits"]
