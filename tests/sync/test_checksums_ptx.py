"""The fingerprint kernel compiled for sm_90 (Hopper) without a GPU: it compiles (the
interpreter tests cannot see compile-only errors such as an unsupported 64-bit atomic) and adds
both sums of a program with exactly two 64-bit atomics. Needs Triton (skipped in CPU CI);
compiled in a fresh process by tests/sync/checksums_ptx.py."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.triton_cpu import run_ptx_script

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton not installed (CPU CI): GPU test tests/gpu/test_triton_checksums.py "
                "covers it", allow_module_level=True)


def test_two_64_bit_atomics_per_program():
    ptx = run_ptx_script("tests/sync/checksums_ptx.py")
    atomics = {k: v for k, v in ptx.items() if k.startswith("atom.global")}
    assert sum(atomics.values()) == 2, ptx
    assert any("64" in k for k in atomics), ptx
    assert ptx.get("ld.global.b32", 0) > 0, ptx
