#!/usr/bin/env python3
"""The aligned forward's once-per-step expert refresh alone: torch vs fused fake quantization.

    python3 bench/fake_quant_speed.py --out $OUT/fake_quant_speed.jsonl          # H200, ~1 min
    python3 bench/fake_quant_speed.py --device cpu --tiny --layers 1 --experts 4   # smoke

The expert stacks of ``--layers`` Qwen3-30B-A3B layers (``linear_fc1`` ``[E, 1536, 2048]``
gate/up, ``linear_fc2`` ``[E, 2048, 768]``, bf16, ``randn * 0.02`` with an outlier row every
97; ``--tiny``: ``[E, 256, 256]`` / ``[E, 256, 128]``), refreshed per format as the aligned
stacked experts refresh them after an optimizer step
(:meth:`~megatron_qrl.te_quant.te_grouped.AlignedStackedGroupedLinear.quantized_weights`):
:func:`~megatron_qrl.te_quant.shard_quant.fake_quant_stack_in_place` per stack (nvfp4, whose
gate and up have a tensor scale each: :func:`~megatron_qrl.te_quant.shard_quant.quantize_shards_stacked`)
recording finiteness in one :class:`~megatron_qrl.quant.finite_checks.FiniteChecks`, checked
once at the end. Each of ``--impls`` runs under ``set_quant_impl`` of its name: ``torch``, the
formats' ``_fake_quant``; ``triton``, :mod:`megatron_qrl.quant.triton_fake`.

Per format, one pass of each implementation is compared bit for bit with the first's (a
difference: the row names the first stack that differs and how many values; exit status 1);
then ``--warmup`` + ``--repeats`` timed passes, interleaved (CUDA events around a pass over all
stacks; on a CPU the wall clock). One JSON row per format x implementation (``--out``,
appended; the commit in each) and a markdown row: median ms, GB/s of the weights read once and
written once (``2 x bytes / time``), the time over the first implementation's. An
implementation that cannot run here (``triton`` without Triton, or on CPU tensors without
``TRITON_INTERPRET=1``) is a row with ``skipped``. On a CPU the numbers are CPU numbers: they
say that the script works.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._runner import append_records, commit  # noqa: E402
from megatron_qrl.quant import fused, get_spec  # noqa: E402
from megatron_qrl.quant.finite_checks import FiniteChecks  # noqa: E402
from megatron_qrl.te_quant.shard_quant import (  # noqa: E402
    FusionLayout,
    fake_quant_stack_in_place,
    quantize_shards_stacked,
)

FORMATS = ("fp8_block", "w4a16", "fp8", "int8", "nvfp4")
IMPLS = ("torch", "triton")
SHAPES = {False: ((1536, 2048), (2048, 768)), True: ((256, 256), (256, 128))}
"""``--tiny`` -> the (rows, cols) of one expert's fc1 (gate and up) and fc2."""


def expert_stacks(layers: int, experts: int, tiny: bool, device: str
                  ) -> list[tuple[str, torch.Tensor, FusionLayout]]:
    """``(label, [E, out, in] bf16 stack, layout)`` of fc1 and fc2 per layer."""
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for layer in range(layers):
        for name, (n, k), layout in zip(("linear_fc1", "linear_fc2"), SHAPES[tiny],
                                        (FusionLayout("gate_up"), FusionLayout())):
            w = torch.randn(experts, n, k, generator=g, device=device).mul_(0.02)
            w.view(-1, k)[::97] *= 300.0
            out.append((f"layers.{layer}.mlp.experts.{name}", w.bfloat16(), layout))
    return out


def refresh(spec, stacks) -> list[torch.Tensor]:
    """The aligned experts' refresh of every stack (module doc), one finiteness check."""
    finite = FiniteChecks()
    out = []
    for label, w, layout in stacks:
        q = fake_quant_stack_in_place(spec, w, layout, label, finite)
        if q is None:
            q = torch.stack(quantize_shards_stacked(spec, list(w.unbind(0)),
                                                    [layout] * w.shape[0], label, finite))
        out.append(q)
    finite.check(spec)
    return out


def why_not(impl: str, device: torch.device) -> str | None:
    """Why ``impl`` cannot run on ``device`` here, or None."""
    if impl != "triton":
        return None
    if fused.kernels("triton_fake") is None:
        return "Triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the tensors are on {device} (TRITON_INTERPRET=1 runs the kernels there)"
    return None


def under(impl: str, fn):
    """``fn()`` with the quantizer implementation ``impl``."""
    fused.set_quant_impl(impl)
    try:
        return fn()
    finally:
        fused.set_quant_impl(None)


def first_difference(stacks, got, want) -> str | None:
    """``"<stack>: n of m values"`` of the first stack whose bits differ, or None."""
    for (label, *_), a, b in zip(stacks, got, want):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{label}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        n = int((a.view(torch.int16) != b.view(torch.int16)).sum())
        if n:
            return f"{label}: {n} of {a.numel()} values"
    return None


def pass_ms(fn, device: torch.device) -> float:
    """One pass of ``fn`` in ms: CUDA events on a GPU, the wall clock on a CPU."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def bench_format(fmt: str, stacks, impls: list[str], device: torch.device, repeats: int,
                 warmup: int) -> list[dict]:
    """The rows of one format (module doc)."""
    spec = get_spec(fmt)
    run = [i for i in impls if why_not(i, device) is None]
    rows = {i: {"impl": i, "skipped": why_not(i, device)} for i in impls if i not in run}
    ref = None
    for impl in run:
        out = under(impl, lambda i=impl: refresh(spec, stacks))
        if ref is None:
            ref, rows[impl] = (impl, out), {"impl": impl, "agree": True, "same_as": impl}
            continue
        bad = first_difference(stacks, out, ref[1])
        rows[impl] = {"impl": impl, "agree": bad is None, "same_as": ref[0]}
        if bad is not None:
            rows[impl]["first_difference"] = bad
        del out
    del ref
    times: dict[str, list[float]] = {i: [] for i in run}
    for r in range(warmup + repeats):
        for impl in run:
            ms = pass_ms(lambda i=impl: under(i, lambda: refresh(spec, stacks)), device)
            if r >= warmup:
                times[impl].append(ms)
    nbytes = sum(w.numel() * w.element_size() for _, w, _ in stacks)
    base = statistics.median(times[run[0]]) if run else None
    for impl in run:
        ms = statistics.median(times[impl])
        rows[impl] |= {"ms": ms, "gbs": 2 * nbytes / ms / 1e6, "vs_first": ms / base}
    return [{"format": fmt, "bytes": nbytes} | rows[i] for i in impls]


def table(rows: list[dict]) -> str:
    lines = ["| format | impl | ms | GB/s | vs first | bits |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['format']} | {r['impl']} | skipped: {r['skipped']} | | | |")
            continue
        bits = "same" if r["agree"] else f"DIFFER from {r['same_as']}: {r['first_difference']}"
        lines.append(f"| {r['format']} | {r['impl']} | {r['ms']:.2f} | {r['gbs']:.1f} | "
                     f"{r['vs_first']:.3f} | {bits} |")
    return "\n".join(lines)


def _choices(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    got = [v for v in value.split(",") if v]
    if not got or len(set(got)) != len(got) or any(v not in allowed for v in got):
        raise SystemExit(f"{flag} {value!r}: a comma list of distinct {', '.join(allowed)}")
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--impls", default=",".join(IMPLS), help="the first is the reference")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="small widths: a smoke run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="JSONL file the rows are appended to")
    a = p.parse_args(argv)
    formats = _choices(a.formats, FORMATS, "--formats")
    impls = _choices(a.impls, IMPLS, "--impls")
    dev = torch.device(a.device)
    stacks = expert_stacks(a.layers, a.experts, a.tiny, a.device)
    head = {"bench": "fake_quant_speed", "commit": commit(), "device":
            torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "cpu_numbers": dev.type != "cuda", "layers": a.layers, "experts": a.experts,
            "tiny": a.tiny, "repeats": a.repeats, "warmup": a.warmup}
    rows = [head | r for fmt in formats
            for r in bench_format(fmt, stacks, impls, dev, a.repeats, a.warmup)]
    append_records(a.out, rows)
    print(f"[fake_quant_speed] {a.layers} layers x {a.experts} experts"
          f"{' (tiny widths)' if a.tiny else ''}: {rows[0]['bytes'] / 1e9:.3f} GB of bf16 "
          f"expert weights on {head['device']} (commit {head['commit']}, median of "
          f"{a.repeats})")
    if head["cpu_numbers"]:
        print("[fake_quant_speed] CPU numbers: they say that the script works, not how fast "
              "a GPU refreshes")
    print(table(rows))
    return 0 if all(r.get("agree", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
