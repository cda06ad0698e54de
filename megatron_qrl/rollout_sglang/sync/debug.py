"""Opt-in records of the in-place loader, for measuring and comparing load paths; both are
written inside SGLang's scheduler and cost nothing unless their environment variable is set.

Phase log: where an in-place sync's engine-side time goes (per-bucket phase times).

Set ``QRL_INPLACE_PROFILE=/path/file.jsonl`` in the environment the SGLang engine starts in
(its scheduler processes inherit it). Every bucket the in-place loader applies then appends
one JSON line ``{"pid", "begin", "final", "tensors", "done", "<phase>_s": ...}``; each phase
is timed between device synchronizations, so the numbers add up to the bucket's wall time
(and the synchronizations cost a little: leave it unset outside measurements).
:func:`summarize` folds a file into one row per sync.

State digest: the bits an engine holds after each in-place sync.

Set ``QRL_INPLACE_DIGEST=/path/file.jsonl`` in the environment the SGLang engine starts in (its
scheduler processes inherit it). After the final bucket of every in-place sync the loader then
appends one JSON line ``{"pid", "digest": {name: fingerprint}}``: the
:func:`~megatron_qrl.sync.protocol.checksums.tensor_checksum` (dtype, shape, two wrapping sums of the raw
bits) of every parameter and buffer of the model, and of the tensor attributes of each
post-processed module's quant method and scheme (Marlin workspaces, processed scales).

Two syncs of the same weights through different load paths (SGLang's per-tensor
``FusedMoE.weight_loader`` and :mod:`.loader.expert_batch`'s batched copies) must leave equal
digests. Unlike comparing generated tokens, this does not assume the engine's kernels are
deterministic: on the H200 the nvfp4 engine's greedy agreement with the
reference was 0.953 in one run and 0.969 in the next for the same weights and prompts (the
other formats repeated to the digit), and its batched-vs-per-tensor token check failed; the
digest tells a wrong load from a non-deterministic kernel. Costs one pass over the weights
per sync: leave it unset outside tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megatron_qrl.sync.protocol.checksums import Checksums

PROFILE_ENV = "QRL_INPLACE_PROFILE"


class PhaseLog:
    """Phase timer of one bucket; a no-op unless :data:`PROFILE_ENV` names a file."""

    def __init__(self) -> None:
        self.path = os.environ.get(PROFILE_ENV) or None
        self.phases: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        """Counters written with the bucket's line (e.g. direct expert loads batched)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.path is None:
            yield
            return
        _sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            key = f"{name}_s"
            self.phases[key] = self.phases.get(key, 0.0) + time.perf_counter() - t0

    def write(self, msg: dict, n_tensors: int) -> None:
        if self.path is None:
            return
        rec = {"pid": os.getpid(), "begin": bool(msg.get("begin")), "final": bool(msg.get("final")),
               "tensors": n_tensors, "done": len(msg.get("done", {})), **self.counts, **self.phases}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def summarize(path: str | Path) -> list[dict]:
    """One row per sync of one engine process (``begin`` .. ``final``): summed phase times,
    buckets, tensors and direct expert-load counters, in file order."""
    rows: list[dict] = []
    open_rows: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        row = open_rows.get(rec["pid"])
        if rec["begin"] or row is None:
            row = open_rows[rec["pid"]] = {"pid": rec["pid"], "buckets": 0, "tensors": 0}
            rows.append(row)
        row["buckets"] += 1
        row["tensors"] += rec["tensors"]
        for k, v in rec.items():
            if k.endswith("_s") or k.startswith("experts"):  # phase times and load counters
                row[k] = row.get(k, 0 if isinstance(v, int) else 0.0) + v
        if rec["final"]:
            open_rows.pop(rec["pid"], None)
    for row in rows:
        row["total_s"] = sum(v for k, v in row.items() if k.endswith("_s"))
    return rows


# ---- state digest -------------------------------------------------------------------
DIGEST_ENV = "QRL_INPLACE_DIGEST"


def model_digest(model: torch.nn.Module,
                 post_processed: Callable[[torch.nn.Module], bool]) -> dict[str, str]:
    """``name -> fingerprint`` of the model's kernel state (see the module doc); attributes
    of a module's quant method are named ``module:quant_method.attr`` (or ``:scheme.``)."""
    sums = Checksums()
    for name, t in model.named_parameters():
        sums.add(name, t)
    for name, t in model.named_buffers():
        sums.add(name, t)
    for mname, module in model.named_modules():
        if not post_processed(module):
            continue
        for owner in ("quant_method", "scheme"):
            obj = getattr(module, owner, None)
            for attr, t in sorted(vars(obj).items()) if obj is not None else ():
                if isinstance(t, torch.Tensor):
                    sums.add(f"{mname}:{owner}.{attr}", t)
    return sums.result()


def write_digest(model: torch.nn.Module, final: bool,
                 post_processed: Callable[[torch.nn.Module], bool]) -> None:
    """Append the model's digest to ``$QRL_INPLACE_DIGEST`` after a sync's final bucket."""
    path = os.environ.get(DIGEST_ENV)
    if not path or not final:
        return
    rec = {"pid": os.getpid(), "digest": model_digest(model, post_processed)}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_digests(path: str | Path) -> list[dict[str, str]]:
    """The digests of a file, one per sync, in file order (one engine process)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line)["digest"] for line in p.read_text().splitlines() if line.strip()]


def digest_diff(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ, or that only one digest has, sorted."""
    return sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))


if __name__ == "__main__":  # python -m megatron_qrl.rollout_sglang.sync.debug FILE
    import sys

    for r in summarize(sys.argv[1]):
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
