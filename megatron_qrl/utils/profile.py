"""One ``torch.profiler`` trace of a piece of work, summed up for a JSON record: the wall time,
the GPU's busy time (kernel and copy time, streams summed) — a piece bound by launches, host
syncs or Python shows busy << wall — the top kernels (GPU) or ops (CPU) by time, the top host
ops by self CPU time, the host syncs and the caching allocator's device allocations
(``cudaMalloc`` / ``cudaFree``: each a host stall) the trace saw. Used by qrl-train's
``--qrl-profile-step``, bench/pack_profile.py and bench/weight_sync.py ``--profile``::

    with Traced("cuda") as tr:
        work()
    record["profile"] = tr.summary(top=20)
    tr.export("trace.json")            # chrome://tracing / Perfetto
"""

from __future__ import annotations

import time

__all__ = ["ALLOC_CALLS", "SYNC_CALLS", "Traced", "summarize"]

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "aten::_local_scalar_dense")
"""Trace events where the host waits for the GPU (``cudaMemcpy``: a blocking copy;
``_local_scalar_dense``: ``.item()`` / ``bool(t)``)."""
ALLOC_CALLS = ("cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cuMemCreate",
               "cuMemMap", "cuMemUnmap", "cuMemRelease")
"""Runtime / driver calls of the caching allocator growing or shrinking its device memory
(each synchronizes or stalls the host; a warm allocator makes none)."""


def _dev_us(e) -> float:
    return float(getattr(e, "self_device_time_total", 0.0) or 0.0)


def _on_device(e) -> bool:
    """A kernel or copy on the GPU's timeline: not the CPU op that launched it (its
    ``self_device_time_total`` is the same kernels' time again) and not a ``record_function``
    range's GPU-side annotation (the time of every kernel under it)."""
    return (str(getattr(e, "device_type", "")).endswith("CUDA")
            and not getattr(e, "is_user_annotation", False))


def summarize(events, wall: float, on_gpu: bool, top: int = 20) -> dict:
    """``wall_s``, ``gpu_busy_s`` (None off the GPU: each kernel and copy counted once),
    ``top_time_ms`` (the GPU's kernels, or the CPU's ops off the GPU) / ``top_host_self_ms``
    (``[name, ms, calls]``), ``host_syncs`` (``{call: count}``), ``allocator`` (``{call:
    [count, host ms]}`` of :data:`ALLOC_CALLS`) and ``ranges_ms`` (the ``qrl.*``
    ``record_function`` ranges' wall, e.g. the direct sync's write step) of
    ``prof.key_averages()``."""
    if on_gpu:
        kernels = sorted((e for e in events if _on_device(e)), key=_dev_us, reverse=True)[:top]
    else:
        kernels = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    busy = sum(_dev_us(e) for e in events if _on_device(e)) / 1e6 if on_gpu else None
    return {
        "wall_s": round(wall, 3), "gpu_busy_s": None if busy is None else round(busy, 3),
        "top_time_ms": [(e.key[:90], round((_dev_us(e) if on_gpu else e.self_cpu_time_total)
                                           / 1e3, 2), e.count) for e in kernels],
        "top_host_self_ms": [(e.key[:90], round(e.self_cpu_time_total / 1e3, 2), e.count)
                             for e in host],
        "host_syncs": {e.key: e.count for e in events if e.key in SYNC_CALLS},
        "allocator": {e.key: [e.count, round(e.self_cpu_time_total / 1e3, 2)] for e in events
                      if e.key in ALLOC_CALLS},
        "ranges_ms": {e.key: round(e.cpu_time_total / 1e3, 2) for e in events
                      if e.key.startswith("qrl.")},
    }


class Traced:
    """``torch.profiler`` over a ``with`` block (CPU, and CUDA where ``device`` is one); the
    wall time is the block's, the device synchronized before and after it."""

    def __init__(self, device: str):
        self.on_gpu = str(device).startswith("cuda")
        self.prof = None
        self.wall = 0.0

    def _sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()

    def __enter__(self) -> Traced:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
        self._sync()
        self.prof = profile(activities=acts)
        self.prof.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.wall = time.perf_counter() - self._t0
        self.prof.__exit__(*exc)

    def summary(self, top: int = 20) -> dict:
        return summarize(self.prof.key_averages(), self.wall, self.on_gpu, top)

    def export(self, path) -> str:
        """The trace as a Chrome trace file at ``path``; returns the path."""
        self.prof.export_chrome_trace(str(path))
        return str(path)
