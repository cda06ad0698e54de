"""The sync's content fingerprints as one Triton kernel: both wrapping sums of many segments
of a flat 32-bit word buffer in one launch (:func:`segment_sums`), or of segments anywhere in
the device's memory, given by byte address (:func:`address_sums`: every region of a sync, in
many tensors, in one launch; :class:`~.checksums.Checksums` takes its batches so).

:func:`~.checksums.checksum_parts` defines a tensor's fingerprint sums over its 32-bit words
``w_i`` (zero-padded, sign-extended to int64), modulo 2^64:

    a = sum_i w_i,    b = sum_i w_i * (i mod 1,000,003 + 1)

The torch code takes them with ~12 kernels per chunk of words over int64 copies (a prefix sum
per chunk and column); here every program reads ``BLOCK * ITERS`` words of one segment once,
keeps both partial sums in registers and adds them to the segment's row with two integer
atomics. Integer addition modulo 2^64 is exact and order-free, so the result equals the torch
code bit for bit whatever order the atomics land in (``tests/sync/test_triton_checksums.py``
under Triton's interpreter, ``tests/gpu/test_triton_checksums.py`` compiled).

The position weight ``i mod 1,000,003 + 1`` takes no per-word division. A program covers the
``BLOCK * ITERS <= 1,000,003`` consecutive positions ``i = f + l`` (``f`` its first, ``l`` in
``[0, BLOCK * ITERS)``), so with the scalar ``r = f mod 1,000,003`` taken once per program,

    i mod 1,000,003 = r + l               if r + l < 1,000,003
                      r + l - 1,000,003   otherwise

(``r + l < 2 * 1,000,003``: one conditional subtraction). ``l``, ``r + l`` and the weight fit
int32 (:func:`segment_sums` refuses a modulus or a program span where they would not); only the
segment's base address, the word, the product ``w_i * weight`` (up to 2^51) and the sums are
64-bit. (An int64 ``%`` per word compiles to a 64-bit multiply-high, a 64-bit multiply and
shifts per word, each an emulated sequence of 32-bit instructions on the GPU;
``tests/sync/test_checksums_ptx.py`` counts the kernel's 64-bit multiplies.)
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "ITERS", "NUM_WARPS", "address_sums", "program_table", "segment_sums"]

BLOCK = 1024
"""Words one program reads per step."""
ITERS = 16
"""Steps per program: a program covers ``BLOCK * ITERS`` words of one segment."""
NUM_WARPS = 4
"""Warps per program (Triton's default; ``bench/fingerprint_speed.py --configs`` times
others)."""


@triton.jit
def _segment_sums_kernel(words_ptr, table_ptr, starts_ptr, lens_ptr, out_ptr,
                         BLOCK: tl.constexpr, ITERS: tl.constexpr, MOD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    seg = tl.load(table_ptr + 2 * pid)
    first = tl.load(table_ptr + 2 * pid + 1)  # this program's first word in the segment
    start = tl.load(starts_ptr + seg)
    n = tl.load(lens_ptr + seg)
    base = (first % MOD).to(tl.int32)  # once per program: the first position's residue
    left = tl.minimum(n - first, BLOCK * ITERS).to(tl.int32)  # words of the segment left here
    ptr = words_ptr + (start + first)  # 64-bit base address; the offsets below are int32
    a = tl.zeros([BLOCK], dtype=tl.int64)
    b = tl.zeros([BLOCK], dtype=tl.int64)
    for i in tl.static_range(ITERS):
        local = i * BLOCK + tl.arange(0, BLOCK)
        w = tl.load(ptr + local, mask=local < left, other=0).to(tl.int64)
        p = base + local  # < 2 * MOD: one wrap at most
        p = tl.where(p >= MOD, p - MOD, p)
        a += w
        b += w * (p + 1).to(tl.int64)
    tl.atomic_add(out_ptr + 2 * seg, tl.sum(a, axis=0))
    tl.atomic_add(out_ptr + 2 * seg + 1, tl.sum(b, axis=0))


@triton.jit
def _address_sums_kernel(table_ptr, addrs_ptr, lens_ptr, out_ptr,
                         BLOCK: tl.constexpr, ITERS: tl.constexpr, MOD: tl.constexpr):
    """:func:`_segment_sums_kernel` over segments anywhere in the device's memory: segment
    ``seg``'s words start at the byte address ``addrs[seg]`` (4-byte aligned), turned into a
    pointer here, so one launch covers regions of many tensors."""
    pid = tl.program_id(0).to(tl.int64)
    seg = tl.load(table_ptr + 2 * pid)
    first = tl.load(table_ptr + 2 * pid + 1)
    n = tl.load(lens_ptr + seg)
    base = (first % MOD).to(tl.int32)
    left = tl.minimum(n - first, BLOCK * ITERS).to(tl.int32)
    ptr = tl.load(addrs_ptr + seg).to(tl.pointer_type(tl.int32)) + first
    a = tl.zeros([BLOCK], dtype=tl.int64)
    b = tl.zeros([BLOCK], dtype=tl.int64)
    for i in tl.static_range(ITERS):
        local = i * BLOCK + tl.arange(0, BLOCK)
        w = tl.load(ptr + local, mask=local < left, other=0).to(tl.int64)
        p = base + local
        p = tl.where(p >= MOD, p - MOD, p)
        a += w
        b += w * (p + 1).to(tl.int64)
    tl.atomic_add(out_ptr + 2 * seg, tl.sum(a, axis=0))
    tl.atomic_add(out_ptr + 2 * seg + 1, tl.sum(b, axis=0))


def program_table(starts: list[int], lengths: list[int], chunk: int) -> np.ndarray:
    """``int64[2 * P + 2 * n]``: the kernel's program table — for each of the ``P`` programs its
    segment and its first word in that segment (``chunk`` words per program, segments split
    into ``ceil(length / chunk)`` programs) — then the ``n`` segments' starts and lengths.

    Built with numpy on the host: torch's CPU ``repeat_interleave`` takes milliseconds per call
    in an OpenMP region (4.7 s over the 676 calls of one 30B sync beside an engine on the
    H200), numpy's ``repeat`` microseconds."""
    lens = np.asarray(lengths, dtype=np.int64)
    blocks = (lens + chunk - 1) // chunk
    seg = np.repeat(np.arange(lens.size, dtype=np.int64), blocks)
    first = (np.arange(seg.size, dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)) * chunk
    table = np.stack([seg, first], 1).reshape(-1)
    return np.concatenate([table, np.asarray(starts, dtype=np.int64), lens])


def _check_mod(mod: int) -> int:
    chunk = BLOCK * ITERS
    if not 0 < mod <= 2**30 or chunk > mod:
        raise ValueError(f"segment_sums takes one residue per program: it needs "
                         f"BLOCK * ITERS = {chunk} <= mod = {mod} <= 2^30 (int32 positions)")
    return chunk


def _to_device(meta: np.ndarray, device: torch.device) -> torch.Tensor:
    """The program table on ``device``: one host-to-device copy, from pinned memory on a GPU
    (queued like a kernel; a copy from pageable memory waits for the stream)."""
    t = torch.from_numpy(meta)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def address_sums(addrs: np.ndarray, lengths: np.ndarray, mod: int,
                 device: torch.device) -> torch.Tensor:
    """``int64[n, 2]`` on ``device``: both fingerprint sums of each segment of ``lengths[k]``
    32-bit words at byte address ``addrs[k]`` (4-byte aligned, in ``device``'s memory, alive
    until the kernel has run: the caller holds the tensors), positions counted from each
    segment's start: what :func:`segment_sums` gives for the same words, in one launch for
    regions of any number of tensors (no copy into one buffer). No host sync."""
    chunk = _check_mod(mod)
    n = len(lengths)
    out = torch.zeros(n, 2, dtype=torch.int64, device=device)
    meta = program_table(addrs, lengths, chunk)
    total = (meta.size - 2 * n) // 2
    if not total:
        return out
    meta = _to_device(meta, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _address_sums_kernel[(total,)](
            meta[:2 * total], meta[2 * total:2 * total + n], meta[2 * total + n:], out,
            BLOCK=BLOCK, ITERS=ITERS, MOD=mod, num_warps=NUM_WARPS)
    return out


def segment_sums(words: torch.Tensor, starts: list[int], lengths: list[int],
                 mod: int) -> torch.Tensor:
    """``int64[n, 2]`` on ``words``' device: both fingerprint sums of each segment
    ``words[starts[k] : starts[k] + lengths[k]]`` of the contiguous int32 buffer ``words``,
    positions counted from each segment's start. The segment table goes to the GPU from
    pinned memory without waiting for the stream: no host sync (a sync fingerprints every
    region it wrote; the host keeps queueing the next weight's kernels meanwhile)."""
    if words.dtype != torch.int32 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError(f"segment_sums needs a contiguous 1-D int32 word buffer, got "
                         f"{words.dtype} {tuple(words.shape)}")
    chunk = _check_mod(mod)
    n = len(lengths)
    out = torch.zeros(n, 2, dtype=torch.int64, device=words.device)
    meta = program_table(starts, lengths, chunk)
    total = (meta.size - 2 * n) // 2
    if not total:
        return out
    meta = _to_device(meta, words.device)  # the table, starts and lengths: one copy
    _segment_sums_kernel[(total,)](
        words, meta[:2 * total], meta[2 * total:2 * total + n], meta[2 * total + n:],
        out, BLOCK=BLOCK, ITERS=ITERS, MOD=mod, num_warps=NUM_WARPS)
    return out
