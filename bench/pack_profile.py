#!/usr/bin/env python3
"""Where the trainer side of a weight sync spends its time: one ``torch.profiler`` trace of
``QuantSpec.pack_state_dict`` over the Qwen3-30B-A3B-shaped stream of bench/weight_sync.py.

    python bench/pack_profile.py --format fp8 --layers 8 --out pack_profile.json

Prints (and writes as JSON) the wall time, the GPU's busy time (kernels, streams summed), the
kernels with the most GPU time and the host ops with the most own (self) CPU time, so a pack
bound by launches / Python shows up as busy << wall. The stream is quantized once untraced
first (warm-up: allocator, kernel caches). ``--device cpu`` checks the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.weight_sync import _synchronize, model_config, trainer_stream  # noqa: E402


def _drain(spec, cfg: dict, device: str, stack_experts: bool) -> int:
    n = 0
    for _, t in spec.pack_state_dict(trainer_stream(cfg, device), stack_experts=stack_experts):
        n += t.numel() * t.element_size()
    _synchronize(device)
    return n


def profile_pack(fmt: str, layers: int, device: str, stack_experts: bool = True,
                 top: int = 20, experts: int | None = None) -> dict:
    """One traced pack of ``layers`` decoder layers in ``fmt``: wall / busy seconds, the top
    kernels (GPU) or ops (CPU) by time, the top host ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_qrl.quant import get_spec

    spec, cfg = get_spec(fmt), model_config(layers, experts)
    _drain(spec, cfg, device, stack_experts)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        nbytes = _drain(spec, cfg, device, stack_experts)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    on_gpu = device.startswith("cuda")

    def dev_us(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or 0.0)

    kernels = sorted(events, key=dev_us if on_gpu else (lambda e: e.self_cpu_time_total),
                     reverse=True)[:top]
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    busy = sum(dev_us(e) for e in events) / 1e6 if on_gpu else None
    return {
        "format": fmt, "layers": layers, "device": device, "stack_experts": stack_experts,
        "wall_s": round(wall, 3), "gpu_busy_s": None if busy is None else round(busy, 3),
        "packed_gb": round(nbytes / 1e9, 3),
        "top_time_ms": [(e.key[:90], round((dev_us(e) if on_gpu else e.self_cpu_time_total)
                                           / 1e3, 2), e.count) for e in kernels],
        "top_host_self_ms": [(e.key[:90], round(e.self_cpu_time_total / 1e3, 2), e.count)
                             for e in host],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="fp8")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--experts", type=int, default=None, help="experts per layer (default 128)")
    p.add_argument("--no-stack-experts", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    res = profile_pack(a.format, a.layers, a.device, not a.no_stack_experts, experts=a.experts)
    commit = (ROOT / ".commit").read_text().strip() if (ROOT / ".commit").is_file() else None
    res["commit"] = commit
    print(f"[pack profile] {a.format}, {a.layers} layers on {a.device}: wall {res['wall_s']} s, "
          f"GPU busy {res['gpu_busy_s']} s, {res['packed_gb']} GB packed (commit {commit})")
    for title, key in (("time", "top_time_ms"), ("host self", "top_host_self_ms")):
        print(f"-- top by {title} (ms, calls)")
        for name, ms, n in res[key]:
            print(f"  {ms:10.2f}  {n:6d}  {name}")
    if a.out:
        tmp = a.out.with_suffix(a.out.suffix + ".tmp")
        tmp.write_text(json.dumps(res) + "\n")
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
