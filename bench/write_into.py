#!/usr/bin/env python3
"""The direct sync's write alone: ``QuantSpec.quantize_into`` of one Qwen3-30B-A3B layer's
expert stacks (gate / up ``[128, 768, 2048]`` into the two halves of a ``w13``-like region,
down ``[128, 2048, 768]``) through the format's torch reference and through ``auto`` (its fused
into-kernel on CUDA), side by side in one run.

    python bench/write_into.py --formats fp8,int8,fp8_block --out bench/results/write_into.jsonl

One row per (format, implementation): median ms per layer over ``--repeats`` (host clock
around the writes and a device synchronize),
the bytes read + written, GB/s, the 48-layer projection, and ``vs_torch`` (torch ms / this
ms); every row records the commit. The bits written by both implementations are compared
(``same_bits``). ``--device cpu`` checks the script (CPU numbers)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._runner import append_records, commit  # noqa: E402

STACKS = (("gate_proj", (128, 768, 2048), 0), ("up_proj", (128, 768, 2048), 768),
          ("down_proj", (128, 2048, 768), 0))
LAYERS_30B = 48


class Regions:
    """An engine's regions, allocated once: ``w13`` holds gate in rows ``[0, 768)`` and up in
    ``[768, 1536)`` of each expert, as SGLang's fused-MoE parameter does."""

    def __init__(self, device: str):
        self.device, self.held = device, {}

    def __call__(self, name: str, shape, dtype, start: int = 0, rows: int | None = None):
        full = list(shape)
        full[-2] = rows or shape[-2]
        key = (name.rsplit(".", 1)[-1], tuple(full), dtype)
        if key not in self.held:
            self.held[key] = torch.zeros(full, dtype=dtype, device=self.device)
        return self.held[key].narrow(-2, start, shape[-2])


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _write_layer(spec, ws: dict, regions: Regions) -> list[torch.Tensor]:
    out = []
    for proj, _, start in STACKS:
        rows = 2 * 768 if proj != "down_proj" else None
        name = f"model.layers.0.mlp.experts.*.{proj}.weight"
        out += [t for _, t in spec.quantize_into(
            name, ws[proj], lambda n, s, d, st=start, r=rows: regions(n, s, d, st, r))]
    return out


def measure(fmt: str, impl: str, device: str, repeats: int, ws: dict) -> tuple[dict, list]:
    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.fused import set_quant_impl

    spec, regions = get_spec(fmt), Regions(device)
    set_quant_impl(impl)
    try:
        written = _write_layer(spec, ws, regions)  # warm-up (compilation, allocator)
        _sync(device)
        ms = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            _write_layer(spec, ws, regions)
            _sync(device)
            ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        set_quant_impl(None)
    nbytes = sum(w.numel() * w.element_size() for w in ws.values()) + \
        sum(t.numel() * t.element_size() for t in written)
    med = statistics.median(ms)
    row = {"bench": "write_into", "format": fmt, "impl": impl, "device": device,
           "ms_layer": round(med, 3), "bytes": nbytes, "gbs": round(nbytes / med / 1e6, 1),
           "ms_48_layers": round(med * LAYERS_30B, 1), "commit": commit()}
    return row, [t.clone() for t in written]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="fp8,int8,fp8_block")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--experts", type=int, default=128, help="experts per stack (CPU smoke: 2)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    g = torch.Generator(device=a.device).manual_seed(0)
    ws = {proj: (torch.randn((a.experts,) + shape[1:], generator=g, device=a.device) * 0.02
                 ).to(torch.bfloat16) for proj, shape, _ in STACKS}
    rows, worst = [], 0
    for fmt in a.formats.split(","):
        ref, ref_bits = measure(fmt, "torch", a.device, a.repeats, ws)
        got, got_bits = measure(fmt, "auto", a.device, a.repeats, ws)
        same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1
                   else torch.equal(x, y) for x, y in zip(ref_bits, got_bits))
        worst |= not same
        got |= {"vs_torch": round(ref["ms_layer"] / got["ms_layer"], 2), "same_bits": same}
        rows += [ref, got]
    print("| format | impl | ms / layer | GB/s | 48 layers ms | vs torch | same bits |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['impl']} | {r['ms_layer']} | {r['gbs']} | "
              f"{r['ms_48_layers']} | {r.get('vs_torch', '')} | {r.get('same_bits', '')} |")
    print(json.dumps({"commit": commit(), "device": a.device}))
    append_records(a.out, rows)
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
