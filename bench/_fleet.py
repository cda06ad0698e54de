"""``--engines N`` of the rollout benches: N engine processes at once, tok/s of the fleet.

Each engine is its own child process (as one variant is), started with ``1/N`` of the memory
fraction and ``1/N`` of each batch; the children wait for each other at a file barrier before
every timed generate, so their decodes overlap, and the fleet's decode tok/s is the sum of
theirs (its wall time the slowest's). On one GPU this is a sanity check of the fleet (the
engines share the GPU), not a speed claim. ``gpus`` > 1 (``--gpus``, a multi-GPU machine)
puts engine ``i`` on GPU ``i % gpus`` (its ``CUDA_VISIBLE_DEVICES``), and each engine's memory
fraction is divided by the engines sharing its GPU only (:func:`engines_per_gpu`): the
fleet's scaling over GPUs, measured in one run against one engine.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

BARRIER_ENV, ENGINES_ENV = "QRL_BENCH_BARRIER", "QRL_BENCH_ENGINES"
PER_GPU_ENV = "QRL_BENCH_ENGINES_PER_GPU"


def engines_here() -> int:
    """The number of engines of the fleet this child belongs to (1 outside a fleet)."""
    return int(os.environ.get(ENGINES_ENV, "1"))


def engines_per_gpu() -> int:
    """Engines of the fleet sharing this child's GPU (all of them unless spread over GPUs)."""
    return int(os.environ.get(PER_GPU_ENV, engines_here()))


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


def engine_envs(env: dict, engines: int, gpus: int = 1) -> list[dict]:
    """Each child's environment: the fleet's size, and with ``gpus`` > 1 its own GPU
    (engine ``i`` on GPU ``i % gpus``) and the engines sharing it."""
    if gpus < 1 or (gpus > 1 and engines % gpus):
        raise ValueError(f"--gpus {gpus}: must be >= 1 and divide --engines {engines}")
    env = {**env, ENGINES_ENV: str(engines)}
    if gpus == 1:
        return [env] * engines
    return [{**env, "CUDA_VISIBLE_DEVICES": str(i % gpus), PER_GPU_ENV: str(engines // gpus)}
            for i in range(engines)]


def run_fleet(run_one: Callable[[dict, str], dict], env: dict, engines: int,
              batches: list[int], gpus: int = 1) -> dict:
    """``run_one(env, tag)`` for each of ``engines`` children at once (``gpus``:
    :func:`engine_envs`); one combined record (``bs{b}``: out tokens and decode tok/s summed,
    wall / prefill the slowest)."""
    results: list[dict] = [{} for _ in range(engines)]
    with tempfile.TemporaryDirectory(prefix="qrl-bench-fleet-") as d:
        envs = engine_envs({**env, BARRIER_ENV: d}, engines, gpus)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, run_one(envs[i], f"engine {i}"))) for i in range(engines)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    bad = [r for r in results if "error" in r]
    if bad:
        return {**bad[0], "engines": engines}
    out = {**results[0], "engines": engines, "gpus": gpus,
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


def fleet_scaling(rows: list[dict]) -> list[dict]:
    """Decode tok/s of each fleet record (``engines`` > 1) of ``rows`` over the one-engine
    record of the same variant: at the same total batch (``same_total``: the RL step's view,
    one engine decodes the whole batch) and at the fleet's batch per engine (``same_per_engine``:
    the scaling with engines, target >= 1.9x on 2 GPUs); None where no one-engine record
    has that batch size."""
    ones = {r["variant"]: r for r in rows if r.get("engines", 1) == 1 and "error" not in r}
    out = []
    for f in rows:
        n = f.get("engines", 1)
        if n == 1 or "error" in f or f["variant"] not in ones:
            continue
        one = ones[f["variant"]]
        for key in sorted(k for k in f if k.startswith("bs")):
            b, tok = int(key[2:]), f[key]["decode_tok_s"]
            ratio = {k: round(tok / one[k]["decode_tok_s"], 3) for k in (key, f"bs{b // n}")
                     if k in one}
            out.append({"variant": f["variant"], "engines": n, "gpus": f.get("gpus", 1),
                        "batch": b, "fleet_tok_s": tok, "same_total": ratio.get(key),
                        "same_per_engine": ratio.get(f"bs{b // n}")})
    return out
