#!/usr/bin/env python3
"""The output layer's log-prob + entropy pass, torch code vs fused Triton kernels, side by side.

    python bench/logprob_kernel.py --rows 16384 --vocab 151936 --out logprob_kernel.jsonl

Times :func:`~megatron_qrl.losses.logprobs.chunked_log_probs` (per-token log-probs and entropy,
as the policy loss calls it) forward and backward on random ``[rows, vocab]`` logits, once per
implementation of ``--impls`` (:mod:`megatron_qrl.losses.logprobs`: ``torch``, ``triton``) in
one process, and prints per implementation the median forward / backward / total ms, the
achieved GB/s (the least traffic a pass needs over its time: the forward reads the logits once,
the backward reads them and writes their gradient, each in the logits' dtype), the peak memory
above the inputs, and the torch / triton ratio of each time. The largest difference of the
log-probs, entropy and gradient between the implementations is printed as a check. Each run
appends one JSON record with the commit to ``--out``. ``--configs 2048x4,8192x16`` times the
kernels again per block size x warps (:data:`~megatron_qrl.losses.triton_logprobs.BLOCK`,
``NUM_WARPS``), to choose them. ``--device cpu`` checks the script on a CPU (the kernels there
only under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._runner import append_records, commit  # noqa: E402

IMPLS = ("torch", "triton")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_impl(impl: str, x: torch.Tensor, labels: torch.Tensor, g: torch.Tensor,
              temperature: float, repeats: int, warmup: int) -> tuple[dict, tuple]:
    """Median forward / backward ms of ``impl`` and its last ``(log-probs, entropy, grad)``."""
    from megatron_qrl.losses.logprobs import chunked_log_probs, set_logprob_impl

    set_logprob_impl(impl)
    dev = x.device
    fwd, bwd, peak = [], [], 0
    try:
        for i in range(warmup + repeats):
            x.grad = None
            if dev.type == "cuda":
                base = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            t0 = _clock(dev)
            lp, ent = chunked_log_probs(x, labels, temperature, entropy=True)
            t1 = _clock(dev)
            lp.backward(g)
            t2 = _clock(dev)
            if i >= warmup:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
                if dev.type == "cuda":
                    peak = max(peak, torch.cuda.max_memory_allocated(dev) - base)
    finally:
        set_logprob_impl(None)
    f, b = statistics.median(fwd), statistics.median(bwd)
    nbytes = x.numel() * x.element_size()
    res = {"fwd_ms": round(f, 3), "bwd_ms": round(b, 3), "total_ms": round(f + b, 3),
           "fwd_gbs": round(nbytes / f / 1e6, 3), "bwd_gbs": round(2 * nbytes / b / 1e6, 3),
           "total_gbs": round(3 * nbytes / (f + b) / 1e6, 3),
           "peak_extra_gib": round(peak / 2**30, 3) if dev.type == "cuda" else None}
    return res, (lp.detach(), ent.detach(), x.grad)


def _max_diff(a: torch.Tensor, b: torch.Tensor, rows: int = 1024) -> float:
    """``max |a - b|`` in fp32, ``rows`` leading rows at a time (no full-size fp32 copy)."""
    return max((float((a[i:i + rows].float() - b[i:i + rows].float()).abs().max())
                for i in range(0, a.shape[0], rows)), default=0.0)


def time_configs(configs: list[str], *args) -> dict:
    """``{"BLOCKxWARPS": times}`` of the kernels at each block size and warp count."""
    from megatron_qrl.losses import triton_logprobs as kern

    saved, out = (kern.BLOCK, kern.NUM_WARPS), {}
    try:
        for cfg in configs:
            kern.BLOCK, kern.NUM_WARPS = map(int, cfg.split("x"))
            out[cfg] = time_impl("triton", *args)[0]
    finally:
        kern.BLOCK, kern.NUM_WARPS = saved
    return out


def run(rows: int, vocab: int, dtype: str, temperature: float, impls: list[str], device: str,
        repeats: int, warmup: int, seed: int = 0, configs: list[str] = ()) -> dict:
    """One record: each implementation's times on the same logits, and the ratios; the
    kernels' times per ``configs`` (block size x warps)."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=gen, device=dev) * 3).to(DTYPES[dtype])
    labels = torch.randint(0, vocab, (rows,), generator=gen, device=dev)
    g = torch.randn(rows, generator=gen, device=dev)
    x.requires_grad_()
    rec = {"bench": "logprob_kernel", "commit": commit(), "rows": rows, "vocab": vocab,
           "dtype": dtype, "temperature": temperature, "entropy": True, "device":
           torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "repeats": repeats}
    outs = {}
    for impl in impls:
        rec[impl], outs[impl] = time_impl(impl, x, labels, g, temperature, repeats, warmup)
        if len(outs) == 2:  # keep one result set only: each gradient is rows x vocab
            first = next(iter(outs))
            rec["max_diff"] = {k: _max_diff(a, b) for k, a, b in
                               zip(("lp", "ent", "grad"), outs[first], outs[impl])}
            outs = {first: outs[first]}
    if {"torch", "triton"} <= set(impls):
        for key in ("fwd_ms", "bwd_ms", "total_ms"):
            rec[f"ratio_{key[:-3]}"] = round(rec["torch"][key] / rec["triton"][key], 2)
    del outs
    if configs:
        rec["configs"] = time_configs(list(configs), x, labels, g, temperature, repeats,
                                      warmup)
    return rec


def _print(rec: dict, impls: list[str]) -> None:
    print(f"[logprob_kernel] [{rec['rows']}, {rec['vocab']}] {rec['dtype']} T={rec['temperature']} "
          f"+ entropy on {rec['device']} (commit {rec['commit']}, median of {rec['repeats']})")
    print("| impl | fwd ms | bwd ms | total ms | fwd GB/s | bwd GB/s | total GB/s "
          "| peak extra GiB |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [(impl, rec[impl]) for impl in impls]
    rows += [(f"triton {cfg}", r) for cfg, r in rec.get("configs", {}).items()]
    for impl, r in rows:
        print(f"| {impl} | {r['fwd_ms']} | {r['bwd_ms']} | {r['total_ms']} | {r['fwd_gbs']} | "
              f"{r['bwd_gbs']} | {r['total_gbs']} | {r['peak_extra_gib']} |")
    if "ratio_total" in rec:
        print(f"[logprob_kernel] torch / triton: fwd x{rec['ratio_fwd']}, bwd x{rec['ratio_bwd']}, "
              f"total x{rec['ratio_total']}")
    if "max_diff" in rec:
        print(f"[logprob_kernel] max |difference|: {rec['max_diff']}")


def _configs(text: str) -> list[str]:
    configs = [s.strip() for s in text.split(",") if s.strip()]
    for cfg in configs:
        block, _, warps = cfg.partition("x")
        if not (block.isdigit() and warps.isdigit() and int(block) & (int(block) - 1) == 0
                and int(block) > 0 and int(warps) in (1, 2, 4, 8, 16, 32)):
            raise SystemExit(f"--configs {text!r}: each is BLOCKxWARPS, a power-of-two block "
                             "and 1-32 warps (e.g. 4096x8,8192x16)")
    return configs


def _impls(text: str) -> list[str]:
    impls = [s.strip() for s in text.split(",") if s.strip()]
    if not impls or any(s not in IMPLS for s in impls) or len(set(impls)) < len(impls):
        raise SystemExit(f"--impls {text!r}: use one or both of {', '.join(IMPLS)}, "
                         "comma-separated (e.g. torch,triton)")
    return impls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--impls", default="torch,triton")
    p.add_argument("--configs", default="",
                   help="kernel block size x warps to time as well, e.g. 2048x4,8192x16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="JSONL file the record is appended to")
    a = p.parse_args(argv)
    impls, configs = _impls(a.impls), _configs(a.configs)
    rec = run(a.rows, a.vocab, a.dtype, a.temperature, impls, a.device, a.repeats, a.warmup,
              configs=configs)
    _print(rec, impls)
    append_records(a.out, [rec])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
