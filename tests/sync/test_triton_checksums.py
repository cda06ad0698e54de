"""The sync's fingerprints taken by the one-launch Triton kernel
(megatron_qrl/sync/protocol/triton_checksums.py) equal the torch code's bit for bit, run by
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before Triton loads):
many tensors of mixed dtypes and odd byte counts, empty ones, stacked rows, segments longer
than one program, words whose weighted sums wrap modulo 2^64 past position 1,000,003, and
programs whose span of positions straddles a multiple of the modulus (the kernel's one
conditional subtraction instead of a per-word ``%``).
The compiled kernel at a 30B sync's sizes: tests/gpu/test_triton_checksums.py.

Run: ``PYTHONPATH=/tmp/triton_site:$PWD pytest tests/sync/test_triton_checksums.py`` (Triton
installed aside; the shared venv has none, and there the module skips).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.triton_cpu import require_triton_interpreter

require_triton_interpreter("tests/gpu/test_triton_checksums.py")

from megatron_qrl.sync.protocol import triton_checksums  # noqa: E402
from megatron_qrl.sync.protocol.checksums import (  # noqa: E402
    Checksums,
    checksum_parts,
    checksum_parts_many,
    checksum_rows,
    set_checksum_impl,
    tensor_checksum,
)


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.setattr(triton_checksums, "BLOCK", triton_checksums.BLOCK)
    monkeypatch.setattr(triton_checksums, "ITERS", triton_checksums.ITERS)
    yield
    set_checksum_impl(None)


def _both(fn, *args):
    out = {}
    for impl in ("torch", "triton"):
        set_checksum_impl(impl)
        out[impl] = fn(*args)
    set_checksum_impl(None)
    return out["torch"], out["triton"]


def _mixed(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 5, generator=g).to(torch.bfloat16),
            torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8),  # 7 bytes: padded
            torch.empty(0),
            torch.randn(3, 129, generator=g),
            torch.randint(-2**62, 2**62, (11,), generator=g, dtype=torch.int64),
            torch.randint(0, 256, (1,), generator=g, dtype=torch.uint8)]


@pytest.mark.parametrize("block,iters", [(1024, 16), (16, 2)])
def test_many_tensors_equal_the_torch_code(monkeypatch, block, iters):
    """(16, 2): every tensor but the smallest spans several programs (atomics from each)."""
    monkeypatch.setattr(triton_checksums, "BLOCK", block)
    monkeypatch.setattr(triton_checksums, "ITERS", iters)
    ts = _mixed(0)
    ref, got = _both(checksum_parts_many, ts)
    assert torch.equal(ref, got)
    assert torch.equal(got, torch.stack([checksum_parts(t) for t in ts]))


def test_wrapping_sums_past_the_position_modulus():
    """1,000,010 words of 2^31 - 1: the weighted sum passes 2^63 (wraps) and the positions
    pass the modulus 1,000,003 (the weight restarts at 1)."""
    big = torch.full((1_000_010,), 2**31 - 1, dtype=torch.int32)
    neg = torch.full((1_000_010,), -2**31, dtype=torch.int32)
    ref, got = _both(checksum_parts_many, [big, neg])
    assert torch.equal(ref, got)
    exact = [sum(range(1, 1_000_004)) + sum(range(1, 8)), 1_000_010]
    want_b = ((2**31 - 1) * exact[0] + 2**63) % 2**64 - 2**63
    assert int(got[0, 1]) == want_b and int(got[0, 0]) == (2**31 - 1) * exact[1]


def test_a_program_straddling_the_position_modulus():
    """Random words in a segment of 1,030,000 words: the program of positions
    [61 * 16384, 62 * 16384) holds position 1,000,003, where the weight restarts at 1 in the
    middle of the program (random words: every position's weight counts)."""
    chunk = triton_checksums.BLOCK * triton_checksums.ITERS
    mod = 1_000_003
    assert mod % chunk and (mod // chunk + 1) * chunk < 1_030_000  # the straddle is inside
    g = torch.Generator().manual_seed(3)
    long = torch.randint(-2**31, 2**31, (1_030_000,), generator=g, dtype=torch.int64)
    ts = [long.to(torch.int32), torch.randint(-2**31, 2**31, (5,), generator=g).to(torch.int32)]
    ref, got = _both(checksum_parts_many, ts)
    assert torch.equal(ref, got)


def _equation(words: torch.Tensor, starts: list[int], lengths: list[int], mod: int):
    """The module docstring's sums, one segment at a time, modulo 2^64."""
    rows = []
    for s, n in zip(starts, lengths):
        w = [int(x) for x in words[s:s + n]]
        rows.append([sum(w), sum(x * (i % mod + 1) for i, x in enumerate(w))])
    return torch.tensor([[(v + 2**63) % 2**64 - 2**63 for v in r] for r in rows],
                        dtype=torch.int64)


@pytest.mark.parametrize("block,iters,mod", [(16, 2, 61), (8, 4, 32)])
def test_small_modulus_wraps_inside_programs(monkeypatch, block, iters, mod):
    """A modulus of a few programs' spans: the programs' first residues take many values, so
    positions wrap at every offset inside a program (61) and at a span equal to the modulus
    (32, the largest the kernel takes); segments at odd starts with gaps between them."""
    monkeypatch.setattr(triton_checksums, "BLOCK", block)
    monkeypatch.setattr(triton_checksums, "ITERS", iters)
    g = torch.Generator().manual_seed(4)
    words = torch.randint(-2**31, 2**31, (1200,), generator=g, dtype=torch.int64).to(torch.int32)
    starts, lengths = [3, 200, 210, 420], [190, 0, 205, 777]
    got = triton_checksums.segment_sums(words, starts, lengths, mod)
    assert torch.equal(got, _equation(words, starts, lengths, mod))


@pytest.mark.parametrize("mod", [7, 16383, 2**30 + 1])
def test_the_kernel_refuses_a_modulus_its_int32_positions_cannot_take(mod):
    """A program's span of 16,384 positions longer than the modulus (two wraps in a program),
    or a modulus past 2^30 (``residue + offset`` past int32: 2^30 is the largest taken)."""
    words = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="BLOCK \\* ITERS"):
        triton_checksums.segment_sums(words, [0], [4], mod)


@pytest.mark.parametrize("shape,dtype", [((5, 3, 7), torch.float32), ((4, 2050), torch.bfloat16),
                                         ((3, 5), torch.uint8), ((6, 0), torch.float32)])
def test_stacked_rows_equal_the_torch_code(monkeypatch, shape, dtype):
    """Rows of a stack (experts), whole words per row or not (3 x 5 bytes: the fallback)."""
    monkeypatch.setattr(triton_checksums, "BLOCK", 16)
    monkeypatch.setattr(triton_checksums, "ITERS", 2)
    t = (torch.randn(shape) * 100).to(dtype) if dtype != torch.uint8 else \
        torch.randint(0, 256, shape, dtype=dtype)
    ref, got = _both(checksum_rows, t)
    assert torch.equal(ref, got)
    if shape[0] and shape[1]:
        assert torch.equal(got[1], checksum_parts(t[1]))


def test_checksums_results_equal_the_torch_code():
    """The batched fingerprints a sync's sender and the engine's receipt take
    (:class:`Checksums`: queued tensors + stacked rows) are the same strings either way."""
    def run():
        sums = Checksums(batch_bytes=1 << 10, batch_host=True)
        for i, t in enumerate(_mixed(1)):
            sums.add(f"t{i}", t)
        rows = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(2))
        sums.add_rows(["e0", "e1", "e2"], rows.to(torch.bfloat16))
        return sums.result()

    ref, got = _both(run)
    assert ref == got and len(got) == 9


def test_the_kernel_refuses_a_buffer_that_is_not_words():
    with pytest.raises(ValueError, match="contiguous 1-D int32 word buffer"):
        triton_checksums.segment_sums(torch.zeros(4, dtype=torch.int64), [0], [4], 7)


@pytest.mark.parametrize("lengths", [[0], [1, 0, 5], [40, 7, 0, 33, 16], [16] * 9])
def test_the_program_table_lists_every_segments_programs_in_order(lengths):
    chunk = 16
    starts = [3 * k for k in range(len(lengths))]
    want = []
    for k, n in enumerate(lengths):
        want += [v for first in range(0, n, chunk) for v in (k, first)]
    meta = triton_checksums.program_table(starts, lengths, chunk)
    assert meta.tolist() == want + starts + lengths


def test_the_program_table_takes_no_torch_repeat_interleave(monkeypatch):
    """torch's CPU repeat_interleave runs an OpenMP region per call: 4.7 s over one 30B sync's
    676 calls on the H200 beside an engine (bench/results/weight_sync_direct_7e3a1c4.jsonl)."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.repeat_interleave on the host in segment_sums")

    words = torch.arange(100, dtype=torch.int32)
    want = triton_checksums.segment_sums(words, [0, 40], [40, 60], 1_000_003)
    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    got = triton_checksums.segment_sums(words, [0, 40], [40, 60], 1_000_003)
    assert torch.equal(got, want)


def _regions(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Regions of engine-like tensors as the direct sync fingerprints them: whole tensors,
    member rows of a fused parameter, a strided half of every expert's ``w13`` (stacked),
    a column slice (not contiguous: copied), odd byte counts and an address that is not
    4-byte aligned (copied, zero-padded), an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randint(-128, 128, (40, 24), generator=g, dtype=torch.int8)
    w13 = torch.randn(3, 16, 12, generator=g).to(torch.float8_e4m3fn)
    raw = torch.randint(0, 256, (64,), generator=g, dtype=torch.uint8)
    return [("q", qkv[:16]), ("k", qkv[16:28]), ("gate*", w13[:, :8]), ("up*", w13[:, 8:]),
            ("cols", qkv[:, 5:9]), ("odd", raw[1:8]), ("unaligned", raw[2:34]),
            ("scale", torch.randn(40, 1, generator=g)), ("empty", torch.empty(0)),
            ("ragged*", raw[:15].view(3, 5)), ("norm", torch.randn(6, generator=g).half())]


@pytest.mark.parametrize("kept", [False, True])
def test_one_launch_over_regions_of_many_tensors(monkeypatch, kept):
    """:class:`Checksums` on the Triton path reads every region where it lies, in one launch
    of ``address_sums`` per batch (kept regions: one for the whole sync), and gives the torch
    code's strings. Catches: a row address that ignores the stride between rows, a copy of an
    unaligned or ragged tensor placed at another offset, the sums of a batch assigned out of
    order, kept regions counted towards the batch bound (more launches)."""
    monkeypatch.setattr(triton_checksums, "BLOCK", 16)
    monkeypatch.setattr(triton_checksums, "ITERS", 2)
    calls = []
    real = triton_checksums.address_sums
    monkeypatch.setattr(triton_checksums, "address_sums",
                        lambda *a: calls.append(len(a[1])) or real(*a))

    def run():
        sums = Checksums(batch_bytes=64, batch_host=True)
        for name, t in _regions(3):
            if name.endswith("*"):
                sums.add_rows([f"{name}{e}" for e in range(t.shape[0])], t, kept=kept)
            else:
                sums.add(name, t, kept=kept)
        return sums.result()

    ref, got = _both(run)
    assert ref == got and len(got) == 17
    want = {n: tensor_checksum(t) for n, t in _regions(3) if not n.endswith("*")}
    assert {n: got[n] for n in want} == want
    assert got["up*2"] == tensor_checksum(_regions(3)[3][1][2].clone())
    assert calls == [17] if kept else len(calls) > 2


def test_address_sums_equal_segment_sums():
    words = torch.randint(-2**31, 2**31 - 1, (5000,), dtype=torch.int32)
    starts, lens = [0, 7, 4000, 4999], [7, 3993, 999, 1]
    addrs = [words.data_ptr() + 4 * s for s in starts]
    got = triton_checksums.address_sums(np.asarray(addrs), np.asarray(lens), 1_000_003,
                                        words.device)
    assert torch.equal(got, triton_checksums.segment_sums(words, starts, lens, 1_000_003))
