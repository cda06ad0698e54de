"""H200: the compiled one-launch fingerprint kernel (megatron_qrl/sync/protocol/triton_checksums.py)
equals the torch code bit for bit at a Qwen3-30B-A3B sync's sizes: one layer's stacked fp8
experts (128 x [1536, 2048] bytes, 786,432 words a row), a bucket's worth of mixed tensors,
and :class:`Checksums` strings; ``auto`` picks the kernel for CUDA tensors. Prints both
implementations' seconds (no speed claim: the sync's ``fingerprint_s`` / engine ``receipt_s``
with ``QRL_CHECKSUM_IMPL=torch`` vs the default are the A/B, ``bash bench/h200.sh sync``).

Run: ``pytest tests/gpu/test_triton_checksums.py -s`` (< 1 min).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.gpu import skip_unless_compiled_triton

pytestmark = pytest.mark.gpu

skip_unless_compiled_triton()

from megatron_qrl.sync.protocol import checksums, triton_checksums  # noqa: E402
from megatron_qrl.sync.protocol.checksums import (  # noqa: E402
    Checksums,
    checksum_parts_many,
    checksum_rows,
    set_checksum_impl,
)


def _timed(impl: str, fn, *args):
    set_checksum_impl(impl)
    try:
        fn(*args)  # warm-up (the kernel's compile)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args)
        torch.cuda.synchronize()
        return out, time.perf_counter() - t
    finally:
        set_checksum_impl(None)


def test_auto_picks_the_kernel_for_cuda_tensors():
    assert checksums._kernels(torch.device("cuda")) is triton_checksums
    assert checksums._kernels(torch.device("cpu")) is None


def test_stacked_experts_rows_equal_the_torch_code():
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randint(0, 256, (128, 1536, 2048), generator=g, device="cuda", dtype=torch.uint8)
    ref, t_ref = _timed("torch", checksum_rows, w13)
    got, t_got = _timed("triton", checksum_rows, w13)
    print(f"\n[checksums] 128 x 3 MiB rows: torch {t_ref * 1e3:.2f} ms, triton {t_got * 1e3:.2f} ms")
    assert torch.equal(ref, got)


def test_a_bucket_of_mixed_tensors_equals_the_torch_code():
    g = torch.Generator(device="cuda").manual_seed(1)
    ts = []
    for i in range(48):
        ts.append(torch.randn(2048, 4096 + i, generator=g, device="cuda").to(torch.bfloat16))
        ts.append(torch.randn(2048, generator=g, device="cuda").to(torch.bfloat16))
        ts.append(torch.randint(0, 256, (4 * i + 1,), generator=g, device="cuda",
                                dtype=torch.uint8))
    ref, t_ref = _timed("torch", checksum_parts_many, ts)
    got, t_got = _timed("triton", checksum_parts_many, ts)
    print(f"\n[checksums] {len(ts)} tensors, {sum(t.nbytes for t in ts) / 2**20:.0f} MiB: "
          f"torch {t_ref * 1e3:.2f} ms, triton {t_got * 1e3:.2f} ms")
    assert torch.equal(ref, got)

    def strings():
        sums = Checksums()
        for k, t in enumerate(ts):
            sums.add(f"t{k}", t)
        return sums.result()

    assert _timed("torch", strings)[0] == _timed("triton", strings)[0]


def test_the_kernel_does_not_wait_for_the_stream():
    """Fingerprints are queued behind the writes they read, the host goes on. Catches: the
    segment table copied to the GPU from pageable memory (``.to(device)``: the copy waits for
    every kernel queued before it, one host sync per fingerprinted tensor or expert stack)."""
    set_checksum_impl("triton")
    try:
        stacked = torch.randint(0, 255, (8, 64, 256), dtype=torch.uint8, device="cuda")
        rows = [t.clone() for t in stacked.unbind(0)]
        checksum_rows(stacked), checksum_parts_many(rows)  # compiled before the check
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)  # seconds of GPU work queued ahead
        slept = torch.cuda.Event()
        slept.record()
        got_rows, got_many = checksum_rows(stacked), checksum_parts_many(rows)
        waited = slept.query()  # True: a call above waited for the sleep on the host
        torch.cuda.synchronize()
    finally:
        set_checksum_impl(None)
    assert not waited, "a fingerprint call waited for the stream's earlier kernels"
    assert torch.equal(got_rows, got_many)


def test_one_launch_over_kept_regions_of_many_tensors():
    """The direct sync's fingerprints on the GPU: regions of many engine tensors (fused rows,
    a strided half of every expert's w13, an unaligned byte run: copied) ``kept`` and read in
    place by one ``address_sums`` launch; the torch code's strings, and no wait for the
    stream (the table from pinned memory)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    w13 = torch.randn(64, 2 * 768, 2048, generator=g, device="cuda").to(torch.float8_e4m3fn)
    qkv = torch.randn(4096 + 1024, 2048, generator=g, device="cuda").to(torch.float8_e4m3fn)
    raw = torch.randint(0, 256, (4099,), generator=g, device="cuda", dtype=torch.uint8)

    def strings():
        sums = Checksums()
        sums.add_rows([f"gate{e}" for e in range(64)], w13[:, :768], kept=True)
        sums.add_rows([f"up{e}" for e in range(64)], w13[:, 768:], kept=True)
        sums.add("q", qkv[:4096], kept=True)
        sums.add("k", qkv[4096:], kept=True)
        sums.add("odd", raw[1:], kept=True)
        return sums.result()

    assert _timed("torch", strings)[0] == _timed("triton", strings)[0]
    set_checksum_impl("triton")
    try:
        sums = Checksums()
        sums.add_rows([f"up{e}" for e in range(64)], w13[:, 768:], kept=True)
        sums.flush()  # compiled before the check
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)
        slept = torch.cuda.Event()
        slept.record()
        sums.add_rows([f"gate{e}" for e in range(64)], w13[:, :768], kept=True)
        sums.flush()
        waited = slept.query()
        torch.cuda.synchronize()
    finally:
        set_checksum_impl(None)
    assert not waited, "the one-launch fingerprints waited for the stream's earlier kernels"
