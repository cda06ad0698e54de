#!/usr/bin/env python3
"""Where the trainer side of a weight sync spends its time: one ``torch.profiler`` trace of
``QuantSpec.pack_state_dict`` over the Qwen3-30B-A3B-shaped stream of bench/weight_sync.py.

    python bench/pack_profile.py --format fp8 --layers 8 --out pack_profile.json

Prints (and writes as JSON) the wall time, the GPU's busy time (kernels, streams summed), the
kernels with the most GPU time and the host ops with the most own (self) CPU time, so a pack
bound by launches / Python shows up as busy << wall. The stream is quantized once untraced
first (warm-up: allocator, kernel caches, Triton's compilation). ``--device cpu`` checks the
script on a CPU.

``--quant-impl torch,triton`` (the default on CUDA) profiles the pack once per quantizer
implementation (:mod:`megatron_qrl.quant.fused`: the format's torch reference, its fused Triton
kernel) in one run and prints the torch / triton ratio of wall and busy time; one name
profiles that implementation alone (``auto``: what the sync would use).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.weight_sync import _synchronize, model_config, trainer_stream  # noqa: E402
from megatron_qrl.utils.profile import Traced  # noqa: E402

IMPLS = ("auto", "torch", "triton")


def _drain(spec, cfg: dict, device: str, stack_experts: bool) -> int:
    n = 0
    for _, t in spec.pack_state_dict(trainer_stream(cfg, device), stack_experts=stack_experts):
        n += t.numel() * t.element_size()
    _synchronize(device)
    return n


def profile_pack(fmt: str, layers: int, device: str, stack_experts: bool = True,
                 top: int = 20, experts: int | None = None, impl: str = "auto") -> dict:
    """One traced pack of ``layers`` decoder layers in ``fmt`` through quantizer ``impl``:
    wall / busy seconds, the top kernels (GPU) or ops (CPU) by time, the top host ops by self
    CPU time."""
    from megatron_qrl.quant.fused import set_quant_impl

    set_quant_impl(impl)
    try:
        return {"quant_impl": impl, **_profile(fmt, layers, device, stack_experts, top, experts)}
    finally:
        set_quant_impl(None)


def _profile(fmt: str, layers: int, device: str, stack_experts: bool, top: int,
             experts: int | None) -> dict:
    from megatron_qrl.quant import get_spec

    spec, cfg = get_spec(fmt), model_config(layers, experts)
    _drain(spec, cfg, device, stack_experts)
    with Traced(device) as tr:
        nbytes = _drain(spec, cfg, device, stack_experts)
    s = tr.summary(top)
    return {"format": fmt, "layers": layers, "device": device, "stack_experts": stack_experts,
            "wall_s": s["wall_s"], "gpu_busy_s": s["gpu_busy_s"],
            "packed_gb": round(nbytes / 1e9, 3), "top_time_ms": s["top_time_ms"],
            "top_host_self_ms": s["top_host_self_ms"], "host_syncs": s["host_syncs"]}


def _impls(text: str, device: str) -> list[str]:
    impls = [s.strip() for s in text.split(",") if s.strip()] if text else (
        ["torch", "triton"] if device.startswith("cuda") else ["torch"])
    bad = [s for s in impls if s not in IMPLS]
    if bad or not impls:
        raise SystemExit(f"--quant-impl {text!r}: use one or more of {', '.join(IMPLS)}, "
                         "comma-separated (e.g. torch,triton)")
    return impls


def _ratios(runs: list[dict]) -> dict:
    """torch / triton of wall and busy seconds (the fused kernels' speed-up), where both ran."""
    by = {r["quant_impl"]: r for r in runs}
    if not {"torch", "triton"} <= set(by):
        return {}
    out = {}
    for key in ("wall_s", "gpu_busy_s"):
        a, b = by["torch"].get(key), by["triton"].get(key)
        if a and b:
            out[key.replace("_s", "_ratio")] = round(a / b, 2)
    return out


def _commit() -> str | None:
    if (ROOT / ".commit").is_file():
        return (ROOT / ".commit").read_text().strip()
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _print(res: dict) -> None:
    print(f"[pack profile] {res['format']}, {res['layers']} layers on {res['device']}, "
          f"quantizer {res['quant_impl']}: wall {res['wall_s']} s, GPU busy {res['gpu_busy_s']} s, "
          f"{res['packed_gb']} GB packed (commit {res['commit']})")
    for title, key in (("time", "top_time_ms"), ("host self", "top_host_self_ms")):
        print(f"-- top by {title} (ms, calls)")
        for name, ms, n in res[key]:
            print(f"  {ms:10.2f}  {n:6d}  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="fp8")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--experts", type=int, default=None, help="experts per layer (default 128)")
    p.add_argument("--no-stack-experts", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quant-impl", default="",
                   help="quantizer implementations to profile, comma-separated, of "
                        f"{', '.join(IMPLS)} (default: torch,triton on CUDA, torch on a CPU)")
    a = p.parse_args(argv)
    commit = _commit()
    runs = []
    for impl in _impls(a.quant_impl, a.device):
        runs.append({**profile_pack(a.format, a.layers, a.device, not a.no_stack_experts,
                                    experts=a.experts, impl=impl), "commit": commit})
        _print(runs[-1])
    common = ("format", "layers", "device", "stack_experts", "commit")
    res = ({**{k: runs[0][k] for k in common}, "runs": runs, **_ratios(runs)}
           if len(runs) > 1 else runs[0])
    if len(runs) > 1:
        sizes = {r["packed_gb"] for r in runs}
        print(f"[pack profile] {a.format}: torch / triton wall x{res.get('wall_ratio')}, "
              f"GPU busy x{res.get('gpu_busy_ratio')}"
              + ("" if len(sizes) == 1 else f"; PACKED SIZES DIFFER: {sorted(sizes)}"))
    if a.out:
        tmp = a.out.with_suffix(a.out.suffix + ".tmp")
        tmp.write_text(json.dumps(res) + "\n")
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
