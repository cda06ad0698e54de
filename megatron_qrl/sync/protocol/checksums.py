"""What the trainer and an engine compare after a weight sync: content fingerprints of tensors
(:func:`tensor_checksum`, many at once with :class:`Checksums`) and the sender's record of one
sync (:class:`WeightManifest`)::

    manifest = WeightManifest()
    engine.update_weights(manifest.record(stream), version=step)
    manifest.compare(engine.held_checksums())   # WeightSyncError naming the first bad tensor

``manifest.record`` passes the stream through lazily while fingerprinting each tensor, so
nothing is materialised twice on the sender. Imported on both sides of the process boundary
(the SGLang loader fingerprints what it received the same way); imports only torch (and numpy).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from megatron_qrl.utils import kernel_choice

__all__ = ["ENV", "Checksums", "WeightManifest", "WeightSyncError", "checksum_parts",
           "checksum_parts_many", "checksum_rows", "format_checksum", "once_each",
           "set_checksum_impl", "tensor_checksum"]


class WeightSyncError(RuntimeError):
    """The engine holds something other than what the trainer sent (names the tensor)."""


_CHUNK = 1 << 26
_MOD = 1_000_003

ENV = "QRL_CHECKSUM_IMPL"
"""``auto`` / ``torch`` / ``triton`` (:mod:`megatron_qrl.utils.kernel_choice`): who takes the
batched fingerprints (:func:`checksum_parts_many`, :func:`checksum_rows`, :class:`Checksums`'
batches) — the one-launch
Triton kernel of :mod:`.triton_checksums` (auto: for CUDA tensors when Triton imports) or the
torch code below. Both give the same bits. Read in each process (the SGLang scheduler's too)."""

_SETTING = kernel_choice.ImplSetting(ENV, "fingerprint")


def set_checksum_impl(impl: str | None) -> None:
    """Choose the fingerprints' implementation for this process (None: back to :data:`ENV`)."""
    _SETTING.set(impl, "set_checksum_impl")


@functools.cache
def _triton_module() -> ModuleType | None:
    return kernel_choice.import_kernels("megatron_qrl.sync.protocol.triton_checksums")


def _kernels(device: torch.device) -> ModuleType | None:
    return kernel_choice.select_kernels(_SETTING.get(), _triton_module(), device, ENV,
                                        "the tensors are on {device}")


def checksum_parts(t: torch.Tensor) -> torch.Tensor:
    """``int64[2]`` on ``t``'s device: the two wrapping sums of :func:`tensor_checksum`,
    left on the device (no host sync) so a sync of thousands of tensors waits once."""
    t = t.detach()
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    if not t.numel():
        return out
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad or raw.storage_offset() % 4:  # (a view at an odd byte offset: copied to view words)
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=t.device, dtype=torch.int64)
        out[0] += w.sum()
        out[1] += (w * (pos % _MOD + 1)).sum()
    return out


def format_checksum(dtype: torch.dtype, shape: Iterable[int], parts: Iterable[int]) -> str:
    """The fingerprint string of a tensor from its host-side :func:`checksum_parts`."""
    a, b = (int(x) & (2**64 - 1) for x in parts)
    return f"{_head(dtype, shape)}{a:016x}{b:016x}"


def tensor_checksum(t: torch.Tensor) -> str:
    """A content fingerprint of a tensor: dtype, shape and two wrapping int64 sums of its
    32-bit words (plain and position-weighted), computed on the tensor's own device.

    Integer arithmetic modulo 2^64 is exact and order-free, so a CUDA tensor and its CPU copy
    give the same fingerprint, and a 30B-parameter sync is fingerprinted at memory speed on
    the GPU instead of being copied to the host. Many tensors: :class:`Checksums`.
    """
    return format_checksum(t.dtype, t.shape, checksum_parts(t).tolist())


def checksum_parts_many(tensors: list[torch.Tensor], chunk_words: int = 1 << 22) -> torch.Tensor:
    """``int64[n, 2]``: :func:`checksum_parts` of ``n`` tensors on one device, in a few kernels.

    The tensors' bytes (each zero-padded to whole 32-bit words, as :func:`checksum_parts`
    pads) are concatenated once; per chunk of words, each tensor's two sums are differences
    of one prefix sum at its run's ends (no atomics). Integer addition modulo 2^64 is exact
    and order-free, so the rows equal the one-at-a-time sums bit for bit, with ~12 kernels
    per ``chunk_words`` words instead of ~10 per tensor (37k tensors in a 30B-A3B sync).
    """
    device = tensors[0].device
    raws, lengths = [], []
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = (-raw.numel()) % 4
        raws += [raw, raw.new_zeros(pad)] if pad else [raw]
        lengths.append((raw.numel() + pad) // 4)
    out = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    total = sum(lengths)
    if not total:
        return out
    words = torch.cat(raws).view(torch.int32)
    kernels = _kernels(device)
    if kernels is not None:
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        return kernels.segment_sums(words, starts, lengths, _MOD)
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    for c0 in range(0, total, chunk_words):
        c1 = min(c0 + chunk_words, total)
        lo, hi = starts.clamp(c0, c1), ends.clamp(c0, c1)  # each tensor's words in the chunk
        first = torch.repeat_interleave(starts, hi - lo, output_size=c1 - c0)
        w = words[c0:c1].to(torch.int64)
        pos = torch.arange(c0, c1, device=device, dtype=torch.int64) - first
        # segment sums of contiguous runs: differences of one (wrapping) prefix sum
        for col, v in enumerate((w, w * (pos % _MOD + 1))):
            cs = torch.cat([zero, v.cumsum(0)])
            out[:, col] += cs[hi - c0] - cs[lo - c0]
    return out


def checksum_rows(stacked: torch.Tensor, chunk_words: int = 1 << 24) -> torch.Tensor:
    """``int64[E, 2]``: :func:`checksum_parts` of each ``stacked[e]``, in a few kernels.

    For a stack of experts sent as one tensor whose per-expert fingerprints must equal those of
    the experts sent one by one. Each row's bytes are a whole number of 32-bit words here (the
    positions restart at 0 per row, as :func:`checksum_parts` numbers a tensor's words), so the
    sums are row sums of one ``[E, W]`` word view, taken over ``chunk_words``-word blocks of
    rows; rows with a ragged tail fall back to :func:`checksum_parts_many` of the rows.
    Integer sums modulo 2^64 are exact, so the rows equal the one-at-a-time sums bit for bit.
    """
    t = stacked.detach()
    if t.dim() == 0:
        raise ValueError("checksum_rows needs a stacked tensor [E, ...], got a scalar")
    rows = t.shape[0]
    out = torch.zeros(rows, 2, dtype=torch.int64, device=t.device)
    row_bytes = t[0].numel() * t.element_size() if rows else 0
    if not rows or not row_bytes:
        return out
    if row_bytes % 4:
        return checksum_parts_many(list(t.unbind(0)))
    words = _row_words(t, rows, row_bytes)
    width, step = words.shape[1], words.stride(0)
    kernels = _kernels(t.device)
    if kernels is not None:  # the rows' span of the buffer, gaps between rows unread
        flat = words.as_strided(((rows - 1) * step + width,), (1,))
        return kernels.segment_sums(flat, [r * step for r in range(rows)], [width] * rows, _MOD)
    for c0 in range(0, width, chunk_words):  # word columns [c0, c1) of every row
        c1 = min(c0 + chunk_words, width)
        weight = torch.arange(c0, c1, device=t.device, dtype=torch.int64) % _MOD + 1
        per = max(1, chunk_words // (c1 - c0))  # rows per block: ~chunk_words words at once
        for r0 in range(0, rows, per):
            w = words[r0:r0 + per, c0:c1].to(torch.int64)
            out[r0:r0 + per, 0] += w.sum(1)
            out[r0:r0 + per, 1] += (w * weight).sum(1)
    return out


def _row_words(t: torch.Tensor, rows: int, row_bytes: int) -> torch.Tensor:
    """``int32 [rows, row_bytes / 4]``: each row's words; a view of ``t`` (rows strided, no
    copy) where each row is contiguous and 4-byte aligned (an expert stack's region of a
    fused engine parameter: one half of every expert's ``w13``), else of a contiguous copy."""
    try:
        words = t.view(torch.uint8).view(rows, row_bytes).view(torch.int32)
    except RuntimeError:
        return t.contiguous().view(torch.uint8).reshape(rows, row_bytes).view(torch.int32)
    return words if words.stride(1) == 1 else \
        t.contiguous().view(torch.uint8).reshape(rows, row_bytes).view(torch.int32)


class Checksums:
    """:func:`tensor_checksum` of many tensors with one host transfer per device.

    ``add`` queues a device tensor, ``add_rows`` an expert stack; every ``batch_bytes`` of
    queued tensors are fingerprinted together and :meth:`result` fetches all sums at once.
    Where the Triton kernel runs (:data:`ENV`), a batch is one launch reading every tensor
    where it lies (:func:`~.triton_checksums.address_sums`; only a tensor that is not one
    4-byte aligned run of whole words is copied first); the torch code takes the tensors
    together (:func:`checksum_parts_many`) and each stack on its own (:func:`checksum_rows`).
    Host tensors are fingerprinted one by one as they come (no launches to save there, and
    large fresh temporaries cost more than they gain; ``batch_host=True`` batches them too).
    A queued tensor is held until its batch is done and must not change before then;
    ``kept=True`` says it is a view of storage its owner keeps anyway (an engine's live
    parameter): it is held without counting towards ``batch_bytes``.
    """

    def __init__(self, batch_bytes: int = 256 << 20, batch_host: bool = False) -> None:
        self.batch_bytes = batch_bytes
        self.batch_host = batch_host
        self._meta: list[tuple[tuple[str, ...] | list[str], torch.dtype, tuple[int, ...],
                               torch.device]] = []
        self._queued: list[tuple[torch.Tensor, bool]] = []
        """``(tensor, rows)`` in the order added: ``rows`` for a stack (:meth:`add_rows`)."""
        self._queued_bytes = 0
        self._rows: dict[torch.device, list[torch.Tensor]] = {}
        self._taken: dict[str, str] = {}
        """Fingerprints taken elsewhere (:meth:`include`)."""

    def include(self, taken: dict[str, str]) -> None:
        """Add fingerprints another :class:`Checksums` took (e.g. in the engine's process, of
        what it wrote there): :meth:`result` gives them after this one's own."""
        self._taken.update(taken)

    def add(self, name: str, t: torch.Tensor, kept: bool = False) -> None:
        self._meta.append(((name,), t.dtype, tuple(t.shape), t.device))
        if t.device.type == "cpu" and not self.batch_host:
            self._rows.setdefault(t.device, []).append(checksum_parts(t)[None])
            return
        self._queue(t.detach(), False, kept)

    def add_rows(self, names: list[str], stacked: torch.Tensor, kept: bool = False) -> None:
        """Add ``stacked[e]`` under ``names[e]``: fingerprints equal to adding each row on its
        own, taken in a few kernels (:func:`checksum_rows`) instead of per row."""
        if stacked.dim() == 0 or len(names) != stacked.shape[0]:
            raise ValueError(f"add_rows: {len(names)} names for a tensor of shape "
                             f"{tuple(stacked.shape)}; one name per row of dim 0")
        self._meta.append((names, stacked.dtype, tuple(stacked.shape[1:]), stacked.device))
        if stacked.device.type == "cpu" and not self.batch_host:
            self._rows.setdefault(stacked.device, []).append(checksum_rows(stacked))
            return
        self._queue(stacked.detach(), True, kept)

    def _queue(self, t: torch.Tensor, rows: bool, kept: bool) -> None:
        self._queued.append((t, rows))
        if not kept:
            self._queued_bytes += t.numel() * t.element_size()
            if self._queued_bytes >= self.batch_bytes:
                self.flush()

    def flush(self) -> None:
        """Fingerprint the queued tensors now (sums stay on their devices)."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, bool]]] = {}
        for item in self._queued:
            by_device.setdefault(item[0].device, []).append(item)
        for dev, items in by_device.items():
            self._rows.setdefault(dev, []).append(_queued_sums(items, _kernels(dev)))
        self._queued, self._queued_bytes = [], 0

    def passing(self, stream: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """``stream`` unchanged, each tensor added on its way through."""
        for name, t in stream:
            self.add(name, t)
            yield name, t

    def result(self) -> dict[str, str]:
        """``name -> fingerprint`` of every added tensor, in order (:func:`format_checksum`'s
        strings, the hex digits of all sums formatted at once)."""
        self.flush()
        hexes = {dev: _hex_rows(torch.cat(rows)) for dev, rows in self._rows.items()}
        at = dict.fromkeys(hexes, 0)
        out: dict[str, str] = {}
        for names, dt, shape, dev in self._meta:
            head, i = _head(dt, shape), at[dev]
            at[dev] = i + len(names)
            out.update(zip(names, [head + h for h in hexes[dev][i:i + len(names)]]))
        out.update(self._taken)
        return out


def _queued_sums(items: list[tuple[torch.Tensor, bool]], kernels: ModuleType | None
                 ) -> torch.Tensor:
    """``int64[n, 2]``: the sums of ``items`` (:attr:`Checksums._queued` of one device; a
    stack gives one row per ``t[e]``), in order."""
    if kernels is not None:
        addrs, lens, copies = _word_runs(items)  # (copies: alive until the kernel is queued)
        return kernels.address_sums(addrs, lens, _MOD, items[0][0].device)
    parts, singles = [], []
    for t, rows in items:
        if rows:
            if singles:
                parts.append(checksum_parts_many(singles))
                singles = []
            parts.append(checksum_rows(t))
        else:
            singles.append(t)
    if singles:
        parts.append(checksum_parts_many(singles))
    return torch.cat(parts)


def _word_runs(items: list[tuple[torch.Tensor, bool]]
               ) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor]]:
    """``(byte addresses, word counts, tensors to hold)``: the run of 32-bit words each
    fingerprint sums over (a tensor, or each row of a stack), as
    :func:`~.triton_checksums.address_sums` takes them. A tensor that is one contiguous,
    4-byte aligned run of whole words, and each row of a stack whose rows are
    (:func:`_row_words`), is read where it lies; the others are copied, zero-padded to whole
    words as :func:`checksum_parts` pads, into one buffer (the last of the tensors to hold)."""
    addrs: list[np.ndarray | int] = []
    lens: list[np.ndarray | int] = []
    keep: list[torch.Tensor] = []
    copies: list[tuple[int, torch.Tensor]] = []  # (index into addrs, padded bytes)
    for t, rows in items:
        if rows:
            n = t.shape[0]
            row_bytes = t[0].numel() * t.element_size() if n else 0
            if row_bytes and row_bytes % 4 == 0:
                words = _row_words(t, n, row_bytes)
                keep.append(words)
                addrs.append(words.data_ptr() + 4 * words.stride(0) * np.arange(n, dtype=np.int64))
                lens.append(np.full(n, words.shape[1], dtype=np.int64))
                continue
            units = list(t.unbind(0)) if row_bytes else []
            if not units:
                addrs.append(np.zeros(n, dtype=np.int64))
                lens.append(np.zeros(n, dtype=np.int64))
                continue
        else:
            nbytes = t.numel() * t.element_size()
            if t.is_contiguous() and nbytes % 4 == 0 and t.data_ptr() % 4 == 0:
                addrs.append(t.data_ptr())
                lens.append(nbytes // 4)
                continue
            units = [t]
        for u in units:
            raw = u.contiguous().reshape(-1).view(torch.uint8)
            pad = (-raw.numel()) % 4
            copies.append((len(addrs), torch.cat([raw, raw.new_zeros(pad)]) if pad else raw))
            addrs.append(0)
            lens.append(copies[-1][1].numel() // 4)
    if copies:
        buf = torch.cat([raw for _, raw in copies])
        keep.append(buf)
        off = buf.data_ptr()
        for i, raw in copies:
            addrs[i] = off
            off += raw.numel()
    return (np.concatenate([np.atleast_1d(np.asarray(a, dtype=np.int64)) for a in addrs]),
            np.concatenate([np.atleast_1d(np.asarray(n, dtype=np.int64)) for n in lens]), keep)


def _head(dtype: torch.dtype, shape: Iterable[int]) -> str:
    """The part of a fingerprint string before its sums."""
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}:"


def _hex_rows(parts: torch.Tensor) -> list[str]:
    """Each row of ``int64[n, 2]`` sums as :func:`format_checksum` writes them (both sums
    modulo 2^64 in 16 hex digits), all at once: the big-endian bytes of the two's complement
    are the digits of the unsigned value."""
    h = parts.cpu().numpy().astype(">i8").tobytes().hex()
    return [h[i:i + 32] for i in range(0, len(h), 32)]


def once_each(stream: Iterable[tuple[str, torch.Tensor]], seen: set[str] | None = None
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` unchanged; a name sent twice in one sync (or already in ``seen``) raises."""
    seen = set() if seen is None else seen
    for name, t in stream:
        if name in seen:
            raise WeightSyncError(f"tensor {name!r} was sent twice in one weight sync")
        seen.add(name)
        yield name, t


@dataclass
class WeightManifest:
    """What the trainer sent in one sync: ``name -> checksum``, in send order."""

    checksums: dict[str, str] = field(default_factory=dict)

    def record(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass ``stream`` through, fingerprinting every tensor (duplicates are an error);
        the fingerprints land in ``checksums`` when the stream is exhausted."""
        pending = Checksums()
        yield from once_each(pending.passing(stream), set(self.checksums))
        self.checksums.update(pending.result())

    def compare(self, held: dict[str, str]) -> None:
        """Raise :class:`WeightSyncError` on the first tensor missing or different in ``held``."""
        for name, want in self.checksums.items():
            got = held.get(name)
            if got is None:
                raise WeightSyncError(f"engine did not receive tensor {name!r}")
            if got != want:
                raise WeightSyncError(
                    f"engine holds a different {name!r}: sent {want}, engine has {got}")
