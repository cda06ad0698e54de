"""The fingerprint kernel compiled for sm_90 (Hopper) without a GPU: it compiles (the
interpreter tests cannot see compile-only errors such as an unsupported 64-bit atomic), adds
both sums of a program with exactly two 64-bit atomics, takes its per-word position maths in
32 bits (no 64-bit multiply per word: an int64 ``%`` compiles to one multiply-high and one
multiply per word) and keeps its words in registers (the int64 position maths spilled). Needs
Triton (skipped in CPU CI); compiled in a fresh process by tests/sync/checksums_ptx.py."""

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


def test_no_64_bit_multiply_per_word():
    """The weight ``i mod 1,000,003 + 1`` is taken from the program's one residue: 64-bit
    multiplies only for that residue (at most two), while each of the loaded words is
    multiplied by its int32 weight in one widening 32 x 32 -> 64 multiply(-add)."""
    ptx = run_ptx_script("tests/sync/checksums_ptx.py")
    wide = sum(v for k, v in ptx.items() if k.endswith("wide.s32"))
    long = sum(v for k, v in ptx.items() if k.endswith(("lo.s64", "hi.s64")))
    loads = ptx.get("ld.global.b32", 0)
    assert loads > 2 and long <= 2 and wide >= loads, ptx


def test_the_words_stay_in_registers():
    """sm_90 machine code: fewer local-memory loads and stores (spilled registers) than global
    word loads. The int64 position per word spilled: 3,041 ``LDL`` + 2,496 ``STL`` against 132
    ``LDG`` a program, 10,409 instructions in all (1,808 with int32 positions)."""
    ptx = run_ptx_script("tests/sync/checksums_ptx.py")
    loads = ptx.get("sass LDG", 0)
    local = ptx.get("sass LDL", 0) + ptx.get("sass STL", 0)
    assert loads >= ptx.get("ld.global.b32", 0) > 2 and local < loads, ptx


def test_the_address_kernel_reads_words_as_the_segment_kernel_does():
    """The kernel that reads segments at byte addresses (one launch over a sync's regions in
    many tensors) compiles (an int64 turned into a pointer), adds each program's sums with two
    64-bit atomics, multiplies each word by its int32 weight in one widening multiply, and
    keeps its words in registers."""
    ptx = run_ptx_script("tests/sync/checksums_ptx.py")["address"]
    atomics = {k: v for k, v in ptx.items() if k.startswith("atom.global")}
    assert sum(atomics.values()) == 2 and any("64" in k for k in atomics), ptx
    loads = ptx.get("ld.global.b32", 0)
    wide = sum(v for k, v in ptx.items() if k.endswith("wide.s32"))
    long = sum(v for k, v in ptx.items() if k.endswith(("lo.s64", "hi.s64")))
    assert loads > 2 and long <= 2 and wide >= loads, ptx
    assert ptx.get("sass LDL", 0) + ptx.get("sass STL", 0) < ptx.get("sass LDG", 0), ptx
