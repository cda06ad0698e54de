#!/usr/bin/env python3
"""Fake-quant cost before/after the fast path, side by side, on the CPU.

    python bench/fake_quant_ops.py                       # all weight formats, 64 experts
    python bench/fake_quant_ops.py --formats nvfp4 --experts 16 --repeats 3

"before" is ``dequantize(quantize_weight(w))`` (the reference through integer codes, and the
stacked ``fake_quant_many`` as it was: quantize the row-stack, dequantize it); "after" is
:meth:`QuantSpec.quantize_dequantize` (the format's ``_fake_quant``) and today's
:func:`~megatron_qrl.quant.stacked.fake_quant_many`. Both are checked bit for bit first.
Per format it prints:
- aten ops for one bf16 ``[4096, 2048]`` weight (views and metadata not counted) and the
  "full-size" ones among them (an input or output of at least half the weight's elements: the
  passes over memory that set the time on a GPU);
- CPU wall time (median of ``--repeats``) of ``fake_quant_many`` over ``--experts`` bf16
  ``[1536, 2048]`` expert weights, and the ratio before/after.
A CPU is not a GPU: it shows the op count and the arithmetic saved, not the H200 step time
(``--device cuda`` runs the same, bit checks included, on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_qrl.quant import stacked  # noqa: E402
from megatron_qrl.quant.formats import (  # noqa: E402, F401  (registers the formats)
    channel,
    fp8_block,
    nvfp4,
    w4a16,
)
from megatron_qrl.quant.spec import get_spec  # noqa: E402

_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "select",
          "slice", "split", "split_with_sizes", "t", "detach", "alias", "as_strided",
          "lift_fresh", "unbind", "permute", "transpose", "_to_copy_meta"}


class CountOps(TorchDispatchMode):
    """Count aten ops (views excluded) and those touching >= ``big`` elements."""

    def __init__(self, big: int):
        super().__init__()
        self.big, self.ops, self.full = big, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in _VIEWS:
            tensors = [t for t in (*args, *(kwargs or {}).values(),
                                   *(out if isinstance(out, (tuple, list)) else (out,)))
                       if isinstance(t, torch.Tensor)]
            self.ops.append(name)
            if any(t.numel() >= self.big for t in tensors):
                self.full.append(name)
        return out


def before_one(spec, w):
    return spec.dequantize(spec.quantize_weight(w), dtype=w.dtype)


def after_one(spec, w):
    return spec.quantize_dequantize(w)


def before_many(spec, weights):
    """``fake_quant_many`` as it was before the fast path (quantize the stack, dequantize)."""
    amaxes = stacked._amax_list(None, len(weights))
    if not stacked.can_stack(spec, weights):
        return [before_one(spec, w) for w in weights]
    out = []
    for st, rows, amx, label in stacked._stacks(weights, amaxes, "w", stacked.MAX_STACK_ELEMENTS):
        q = stacked._quantize_stack(spec, st, rows, amx, label)
        out.extend(torch.split(spec.dequantize(q, dtype=st.dtype), rows, dim=0))
    return out


def after_many(spec, weights):
    return stacked.fake_quant_many(spec, weights)


def count(fn, spec, w):
    with CountOps(w.numel() // 2) as c:
        fn(spec, w)
    return len(c.ops), len(c.full), c.full


def median_times(fns, spec, weights, repeats):
    """Median wall time of each of ``fns``, run interleaved (a shared machine drifts)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn(spec, weights)
            if weights[0].is_cuda:
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def run_format(fmt: str, experts: int, repeats: int, show_ops: bool, device: str) -> dict:
    spec = get_spec(fmt)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 2048, generator=gen).to(device, torch.bfloat16)
    assert _same(before_one(spec, w), after_one(spec, w)), f"{fmt}: fast path differs"
    n_b, f_b, full_b = count(before_one, spec, w)
    n_a, f_a, full_a = count(after_one, spec, w)
    if show_ops:
        print(f"  {fmt} before full-size: {full_b}\n  {fmt} after  full-size: {full_a}")
    ws = [torch.randn(1536, 2048, generator=gen).mul_(0.02).to(device, torch.bfloat16)
          for _ in range(experts)]
    assert all(_same(a, b) for a, b in zip(before_many(spec, ws[:4]), after_many(spec, ws[:4])))
    t_b, t_a = median_times([before_many, after_many], spec, ws, repeats)
    return {"format": fmt, "ops_before": n_b, "ops_after": n_a, "full_before": f_b,
            "full_after": f_a, "many_s_before": t_b, "many_s_after": t_a}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="nvfp4,w4a16,int8,fp8,fp8_block")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--show-ops", action="store_true", help="list the full-size ops")
    p.add_argument("--device", default="cpu", help="cpu | cuda (checks bits there too)")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ops: one bf16 "
          f"[4096, 2048]; time: fake_quant_many over {args.experts} bf16 [1536, 2048], "
          f"median of {args.repeats}")
    print(f"{'format':10} {'ops b/a':>9} {'full b/a':>9} {'many_s before':>14} "
          f"{'after':>8} {'ratio':>6}")
    for fmt in args.formats.split(","):
        r = run_format(fmt, args.experts, args.repeats, args.show_ops, args.device)
        print(f"{fmt:10} {r['ops_before']:>4}/{r['ops_after']:<4} {r['full_before']:>4}/"
              f"{r['full_after']:<4} {r['many_s_before']:>14.3f} {r['many_s_after']:>8.3f} "
              f"{r['many_s_before'] / r['many_s_after']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
