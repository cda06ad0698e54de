"""``--engines N`` of the rollout benches: N engine processes at once, tok/s of the fleet.

Each engine is its own child process (as one variant is), started with ``1/N`` of the memory
fraction and ``1/N`` of each batch; the children wait for each other at a file barrier before
every timed generate, so their decodes overlap, and the fleet's decode tok/s is the sum of
theirs (its wall time the slowest's). On one GPU this is a sanity check of the fleet (the
engines share the GPU), not a speed claim.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

BARRIER_ENV, ENGINES_ENV = "QRL_BENCH_BARRIER", "QRL_BENCH_ENGINES"


def engines_here() -> int:
    """The number of engines of the fleet this child belongs to (1 outside a fleet)."""
    return int(os.environ.get(ENGINES_ENV, "1"))


def barrier(name: str, timeout_s: float = 1800.0) -> None:
    """Wait until every engine of the fleet reached ``name`` (no-op outside a fleet)."""
    root = os.environ.get(BARRIER_ENV)
    if not root:
        return
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    (d / str(os.getpid())).touch()
    deadline = time.time() + timeout_s
    while len(list(d.iterdir())) < engines_here():
        if time.time() > deadline:
            raise TimeoutError(f"bench fleet barrier {name!r}: the other engines never came")
        time.sleep(0.05)


def run_fleet(run_one: Callable[[dict, str], dict], env: dict, engines: int,
              batches: list[int]) -> dict:
    """``run_one(env, tag)`` for each of ``engines`` children at once; one combined record
    (``bs{b}``: out tokens and decode tok/s summed, wall / prefill the slowest)."""
    results: list[dict] = [{} for _ in range(engines)]
    with tempfile.TemporaryDirectory(prefix="qrl-bench-fleet-") as d:
        env = {**env, BARRIER_ENV: d, ENGINES_ENV: str(engines)}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, run_one(env, f"engine {i}"))) for i in range(engines)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    bad = [r for r in results if "error" in r]
    if bad:
        return {**bad[0], "engines": engines}
    out = {**results[0], "engines": engines,
           "startup_s": max(r.get("startup_s", 0) for r in results)}
    for b in batches:
        per = [r[f"bs{b // engines}"] for r in results]
        out.pop(f"bs{b // engines}", None)
        out[f"bs{b}"] = {"out_tokens": sum(p["out_tokens"] for p in per),
                         "wall_s": max(p["wall_s"] for p in per),
                         "prefill_s": max(p["prefill_s"] for p in per),
                         "decode_tok_s": round(sum(p["decode_tok_s"] for p in per), 1),
                         "per_engine_tok_s": [p["decode_tok_s"] for p in per]}
    return out
