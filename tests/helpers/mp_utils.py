"""Run a function in N local processes joined by gloo; shared by the multi-process tests.

Usage::

    def _body(rank, world_size, port, x):          # module level, so spawn can pickle it
        init_cpu_distributed(rank, world_size, port, tp=2)
        try:
            return do_something(x)
        finally:
            destroy_cpu_distributed()

    results = run_distributed(_body, 2, x)         # list indexed by rank

Each child uses one intra-op thread (the CI machine has 2 cores). An exception in any rank
is re-raised in the parent with every failing rank's traceback.
"""

from __future__ import annotations

import io
import queue as queue_mod
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_qrl.compat.distributed import free_port  # noqa: F401  (re-exported for tests)


def _worker(rank, world_size, port, fn, args, kwargs, results, threads):
    torch.set_num_threads(threads)
    try:
        out = fn(rank, world_size, port, *args, **kwargs)
        # Plain bytes: torch's queue pickler would share tensor storage through file
        # descriptors that die with this process before the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    threads_per_rank: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, port, *args, **kwargs)`` in ``world_size`` processes.

    Returns the per-rank return values (they must be picklable: tensors, numbers, dicts).
    Raises ``RuntimeError`` with the tracebacks if any rank fails or times out.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, kwargs, results, threads_per_rank),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = results.get(timeout=timeout_s)
            if ok:
                outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are probably stuck in a collective
    except queue_mod.Empty:
        errors.append(f"timed out after {timeout_s}s; finished ranks: {sorted(outputs)}")
    finally:
        for proc in procs:
            proc.join(timeout=5 if errors else 60)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    if errors:
        raise RuntimeError("run_distributed failed:\n" + "\n".join(errors))
    return [outputs[r] for r in range(world_size)]
