#!/usr/bin/env python3
"""The weight sync's fingerprints alone, against a plain copy of the same bytes, side by side.

    python3 bench/fingerprint_speed.py --out $OUT/fingerprint_speed.jsonl      # H200, ~1 min
    python3 bench/fingerprint_speed.py --device cpu --tiny --layers 1 --experts 4  # smoke

The engine's storage of a Qwen3-30B-A3B-shaped model in ``--format``'s direct layout
(:func:`bench.sync_census.engine_storage` on ``--device``, random bytes; ``--layers`` /
``--experts`` cut it, ``--tiny`` shrinks the widths) and the regions a direct sync writes and
fingerprints in it: per layer the expert stacks' gate / up halves of ``w13`` and ``w2``
(``[E, 768, 2048]`` / ``[E, 2048, 768]`` fp8, one fingerprint per expert), their fp32 scales,
q / k / v rows of ``qkv_proj``, ``o_proj`` and their scales, the norms and the router; the
embeddings and the output layer. Each path below runs over all of them, ``--warmup`` passes
then ``--repeats`` timed ones (CUDA events around each pass, and the host's wall clock after
a synchronize), then one more under ``torch.profiler`` (:class:`megatron_qrl.utils.profile.Traced`: GPU
busy time, top kernels, host syncs; ``top_kernel_gbs``: the fingerprinted bytes over the
busiest kernel's summed time, for ``kernel`` and ``copy`` that kernel's own bandwidth):

- ``copy``: every engine parameter's bytes copied on the device into one scratch buffer (the
  bandwidth reference: reads and writes the bytes once);
- ``kernel``: the Triton kernel alone
  (:func:`megatron_qrl.sync.protocol.triton_checksums.segment_sums`), one launch per engine
  parameter, one segment per fingerprinted row of its regions, no copies;
- ``addresses``: the Triton kernel that reads segments anywhere in memory
  (:func:`~megatron_qrl.sync.protocol.triton_checksums.address_sums`), one launch for every
  region of every parameter (what :class:`Checksums` launches per batch);
- ``triton`` / ``torch``: :func:`~megatron_qrl.sync.protocol.checksums.checksum_rows` per
  expert stack and :func:`~megatron_qrl.sync.protocol.checksums.checksum_parts_many` of a
  layer's other regions, under ``set_checksum_impl`` of that name;
- ``checksums``: :class:`~megatron_qrl.sync.protocol.checksums.Checksums` as the direct
  writer takes them (``add_rows`` per stack, ``add`` per region, all ``kept``, then
  ``result()``; the default implementation);
- ``readback``: the engine's read-back digest
  (:func:`megatron_qrl.rollout_sglang.sync.loader.live_storage.read_digest`: each region located
  and viewed, then :class:`Checksums`).

``--configs 2048x8x8,1024x8x4`` times the ``kernel`` path again per block size x steps x warps
of :mod:`~megatron_qrl.sync.protocol.triton_checksums` (``BLOCK``, ``ITERS``, ``NUM_WARPS``;
rows ``kernel BxIxW``), to choose them.

Per path one JSON row (``--out``, appended; the commit in each) and a markdown row: median ms,
GB/s of the fingerprinted bytes, the time over the copy's, GPU busy ms, ``top_kernel_gbs``;
the fingerprints of every path must equal the first one's
(the row says where they differ; any difference: exit status 1). A path that cannot run here
(``kernel`` / ``addresses`` / ``triton`` without Triton, or on CPU tensors without ``TRITON_INTERPRET=1``) is a
row with ``skipped``. On a CPU the numbers are CPU numbers: they say that the script works.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._runner import append_records, commit  # noqa: E402
from bench.sync_census import engine_storage, tiny_config  # noqa: E402
from bench.weight_sync import model_config  # noqa: E402
from megatron_qrl.utils.profile import Traced  # noqa: E402

PATHS = ("copy", "kernel", "addresses", "triton", "torch", "checksums", "readback")


@dataclass(frozen=True)
class Region:
    """One region a direct sync writes: its packed name, engine parameter and view."""

    name: str
    param: str
    view: torch.Tensor
    stacked: bool

    def entries(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of each fingerprint it gives (an expert per stack row)."""
        from megatron_qrl.sync.protocol.inplace import expert_names

        v = self.view
        if self.stacked:
            return [(n, v.dtype, tuple(v.shape[1:])) for n in expert_names(self.name, v.shape[0])]
        return [(self.name, v.dtype, tuple(v.shape))]


def packed_names(layout) -> list[str]:
    """The packed names of the regions of every engine parameter, in the layout's order:
    fused members (``q_proj`` of ``qkv_proj``), expert stacks (``experts.*.gate_proj`` of
    ``w13_weight``), plain parameters as they are."""
    names = []
    for param, pl in layout.params.items():
        module, leaf = param.rsplit(".", 1)
        if pl.experts:  # <layer>.mlp.experts.w13_weight -> <layer>.mlp.experts.*.gate_proj.weight
            fused, _, leaf = leaf.partition("_")
            members = sorted(pl.shards, key=pl.shards.get) if fused == "w13" else ["down_proj"]
            names += [f"{module}.*.{m}.{leaf}" for m in members]
        elif pl.shards:  # <layer>.self_attn.qkv_proj.weight -> <layer>.self_attn.q_proj.weight
            parent = module.rsplit(".", 1)[0]
            names += [f"{parent}.{m}.{leaf}" for m in sorted(pl.shards, key=pl.shards.get)]
        else:
            names.append(param)
    return names


def regions(layout, tensors: dict[str, torch.Tensor]) -> list[Region]:
    """Every region of :func:`packed_names`, located and viewed as the writer does
    (:func:`~megatron_qrl.sync.protocol.engine_layout.locate` / ``view``)."""
    from megatron_qrl.sync.protocol.engine_layout import locate, view
    from megatron_qrl.utils.hf_names import STACKED

    out = []
    for name in packed_names(layout):
        target = locate(layout, name)
        pl = layout.params[target.param]
        shape = list(pl.shape)
        if target.rows is not None:
            shape[1 if target.expert == STACKED else 0] = target.rows[1] - target.rows[0]
        v = view(tensors[target.param], pl, target, tuple(shape))
        out.append(Region(name, target.param, v, target.expert == STACKED))
    return out


def storage(cfg: dict, fmt: str, device: str, seed: int = 0) -> tuple:
    """``(layout, tensors)``: the engine's storage on ``device``, random bytes."""
    from megatron_qrl.quant import get_spec

    layout, tensors = engine_storage(cfg, get_spec(fmt), device)
    g = torch.Generator(device=device).manual_seed(seed)
    for t in tensors.values():
        t.view(torch.uint8).random_(generator=g)
    return layout, tensors


Sums = list[tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], torch.Tensor]]
"""``(entries, int64[len(entries), 2])`` per call: fingerprint sums still on the device."""


def _segments(regs: list[Region], base: torch.Tensor) -> tuple[list[int], list[int]]:
    """Word starts and lengths (of ``base``'s words) of every fingerprinted row of ``regs``."""
    starts, lengths = [], []
    for r in regs:
        rows = r.view.unbind(0) if r.stacked else [r.view]
        for row in rows:
            off = (row.storage_offset() - base.storage_offset()) * row.element_size()
            nbytes = row.numel() * row.element_size()
            if not row.is_contiguous() or off % 4 or nbytes % 4:
                raise ValueError(f"{r.name}: a row that is not whole 32-bit words of "
                                 f"{r.param}; the kernel path reads words in place")
            starts.append(off // 4)
            lengths.append(nbytes // 4)
    return starts, lengths


def kernel_plan(regs: list[Region], tensors: dict[str, torch.Tensor]) -> list[tuple]:
    """One ``(words, starts, lengths, entries)`` per engine parameter: the kernel's launches
    (the segment table made here, outside the timing)."""
    by_param: dict[str, list[Region]] = {}
    for r in regs:
        by_param.setdefault(r.param, []).append(r)
    plan = []
    for param, group in by_param.items():
        t = tensors[param]
        words = t.reshape(-1).view(torch.uint8).view(torch.int32)
        starts, lengths = _segments(group, t)
        plan.append((words, starts, lengths, [e for r in group for e in r.entries()]))
    return plan


def address_plan(regs: list[Region]) -> tuple:
    """``(byte addresses, word counts, entries)`` of every fingerprinted row of ``regs``: the
    one launch of ``address_sums`` (the table made here, outside the timing)."""
    import numpy as np

    addrs, lengths = [], []
    for r in regs:
        for row in (r.view.unbind(0) if r.stacked else [r.view]):
            nbytes = row.numel() * row.element_size()
            if not row.is_contiguous() or row.data_ptr() % 4 or nbytes % 4:
                raise ValueError(f"{r.name}: a row that is not whole aligned 32-bit words; "
                                 "the addresses path reads words in place")
            addrs.append(row.data_ptr())
            lengths.append(nbytes // 4)
    return (np.asarray(addrs, dtype=np.int64), np.asarray(lengths, dtype=np.int64),
            [e for r in regs for e in r.entries()])


def run_addresses(plan: tuple, kernels, mod: int, device: torch.device) -> Sums:
    addrs, lengths, entries = plan
    return [(entries, kernels.address_sums(addrs, lengths, mod, device))]


def run_copy(tensors: dict[str, torch.Tensor], scratch: torch.Tensor) -> None:
    for t in tensors.values():
        flat = t.reshape(-1).view(torch.uint8)
        scratch[:flat.numel()].copy_(flat)


def run_kernel(plan: list[tuple], kernels, mod: int) -> Sums:
    return [(entries, kernels.segment_sums(words, starts, lengths, mod))
            for words, starts, lengths, entries in plan]


def run_functions(regs: list[Region]) -> Sums:
    """checksum_rows per stack, checksum_parts_many of each layer's other regions."""
    from megatron_qrl.sync.protocol.checksums import checksum_parts_many, checksum_rows

    out: Sums = []
    singles: list[Region] = []

    def flush():
        if singles:
            out.append(([e for r in singles for e in r.entries()],
                        checksum_parts_many([r.view for r in singles])))
            singles.clear()

    layer = None
    for r in regs:
        here = r.name.split(".layers.")[-1].split(".")[0] if ".layers." in r.name else None
        if here != layer:
            flush()
            layer = here
        if r.stacked:
            out.append((r.entries(), checksum_rows(r.view)))
        else:
            singles.append(r)
    flush()
    return out


def run_checksums(regs: list[Region]) -> dict[str, str]:
    """As the direct writer fingerprints what it wrote (``EngineWriter._record``)."""
    from megatron_qrl.sync.protocol.checksums import Checksums
    from megatron_qrl.sync.protocol.inplace import expert_names

    sums = Checksums()
    for r in regs:
        if r.stacked:
            sums.add_rows(expert_names(r.name, r.view.shape[0]), r.view, kept=True)
        else:
            sums.add(r.name, r.view, kept=True)
    return sums.result()


def run_readback(layout, tensors: dict[str, torch.Tensor], regs: list[Region]) -> dict[str, str]:
    from megatron_qrl.rollout_sglang.sync.loader.live_storage import read_digest

    return read_digest(layout, tensors, {r.name: list(r.view.shape) for r in regs})


def fingerprints(res) -> dict[str, str] | None:
    """``name -> fingerprint string`` of a path's result (the sums fetched once)."""
    from megatron_qrl.sync.protocol.checksums import format_checksum

    if res is None or isinstance(res, dict):
        return res
    out = {}
    for entries, sums in res:
        for (name, dtype, shape), parts in zip(entries, sums.cpu().tolist()):
            out[name] = format_checksum(dtype, shape, parts)
    return out


def agreement(ref: tuple[str, dict[str, str]], got: dict[str, str]) -> dict:
    """``got``'s fingerprints against the reference path's: equal name for name, or the first
    name that differs (or is missing on either side)."""
    path, want = ref
    bad = next((n for n in want if got.get(n) != want[n]), None)
    if bad is None:
        bad = next((n for n in got if n not in want), None)
    row = {"fingerprints": len(got), "same_as": path, "agree": bad is None}
    return row if bad is None else row | {"first_difference": bad}


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int
          ) -> tuple[list[float], list[float], object]:
    """``(event ms, wall ms, last result)`` of ``repeats`` passes after ``warmup``; on a CPU
    both are the wall clock."""
    cuda = device.type == "cuda"
    ms, wall, res = [], [], None
    for i in range(warmup + repeats):
        res = None
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        res = fn()
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        if i >= warmup:
            wall.append((t1 - t0) * 1e3)
            ms.append(start.elapsed_time(end) if cuda else wall[-1])
    return ms, wall, res


def _why_not(path: str, device: torch.device) -> str | None:
    """Why ``path`` cannot run on ``device`` here, or None."""
    import os

    from megatron_qrl.sync.protocol import checksums

    if path not in ("kernel", "addresses", "triton"):
        return None
    if checksums._triton_module() is None:
        return "Triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the tensors are on {device} (TRITON_INTERPRET=1 runs the kernel there)"
    return None


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a CPU smoke's GB/s are small)."""
    return float(f"{x:.4g}")


def _profiled(fn: Callable[[], object], device: torch.device, nbytes: int) -> dict:
    """GPU busy ms, the top kernels and host syncs of one pass; the busiest kernel's GB/s."""
    with Traced(str(device)) as tr:
        fn()
    s = tr.summary(top=4)
    rec = {"busy_ms": None if s["gpu_busy_s"] is None else round(s["gpu_busy_s"] * 1e3, 3),
           "top": s["top_time_ms"][:4], "host_syncs": s["host_syncs"]}
    if s["gpu_busy_s"] is not None and s["top_time_ms"] and s["top_time_ms"][0][1] > 0:
        rec["top_kernel_gbs"] = _sig(nbytes / s["top_time_ms"][0][1] / 1e6)
    return rec


def with_config(kern, config: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with kernel module ``kern``'s ``BLOCK``, ``ITERS``, ``NUM_WARPS`` set to
    ``config`` (``BxIxW``) and restored after."""
    values = tuple(int(v) for v in config.split("x"))

    def run():
        saved = kern.BLOCK, kern.ITERS, kern.NUM_WARPS
        kern.BLOCK, kern.ITERS, kern.NUM_WARPS = values
        try:
            return fn()
        finally:
            kern.BLOCK, kern.ITERS, kern.NUM_WARPS = saved
    return run


def bench(cfg: dict, fmt: str, device: str, paths: list[str], repeats: int, warmup: int,
          profile: bool = True, configs: list[str] = ()) -> tuple[int, list[dict]]:
    """``(bytes fingerprinted, one row per path)`` (module docstring); the first path that
    fingerprints is the others' reference."""
    from megatron_qrl.sync.protocol import checksums

    dev = torch.device(device)
    layout, tensors = storage(cfg, fmt, device)
    regs = regions(layout, tensors)
    nbytes = sum(r.view.numel() * r.view.element_size() for r in regs)
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    if nbytes != held:
        raise RuntimeError(f"the regions cover {nbytes} of the storage's {held} bytes")
    scratch = torch.empty(max(t.numel() * t.element_size() for t in tensors.values()),
                          dtype=torch.uint8, device=dev) if "copy" in paths else None
    fns: dict[str, Callable[[], object]] = {
        "copy": lambda: run_copy(tensors, scratch),
        "triton": lambda: run_functions(regs), "torch": lambda: run_functions(regs),
        "checksums": lambda: run_checksums(regs),
        "readback": lambda: run_readback(layout, tensors, regs)}
    rows, ref, copy_ms = [], None, None
    runs = list(paths) + ([f"kernel {c}" for c in configs] if "kernel" in paths else [])
    for path in runs:
        row = {"path": path}
        why = _why_not(path.split()[0], dev)
        if why:
            rows.append(row | {"skipped": why})
            continue
        if path == "kernel":
            plan = kernel_plan(regs, tensors)
            kern = checksums._triton_module()
            fns["kernel"] = lambda plan=plan, kern=kern: run_kernel(plan, kern, checksums._MOD)
        elif path == "addresses":
            aplan, kern = address_plan(regs), checksums._triton_module()
            fns[path] = lambda aplan=aplan, kern=kern: run_addresses(aplan, kern,
                                                                      checksums._MOD, dev)
        elif path.startswith("kernel "):
            fns[path] = with_config(kern, path.split()[1], fns["kernel"])
        checksums.set_checksum_impl(path if path in ("triton", "torch") else None)
        try:
            ms, wall, res = timed(fns[path], dev, repeats, warmup)
            prof = _profiled(fns[path], dev, nbytes) if profile else {}
            if path in ("checksums", "readback"):
                row["impl"] = "triton" if checksums._kernels(dev) is not None else "torch"
            elif path != "copy":
                row["impl"] = "triton" if path.startswith(("kernel", "addresses")) else path
        finally:
            checksums.set_checksum_impl(None)
        med = statistics.median(ms)
        copy_ms = med if path == "copy" else copy_ms
        row |= {"ms": round(med, 3), "wall_ms": round(statistics.median(wall), 3),
                "gbs": _sig(nbytes / med / 1e6) if med > 0 else None,
                "vs_copy": round(med / copy_ms, 2) if copy_ms else None} | prof
        got = fingerprints(res)
        if got is not None:
            ref = ref or (path, got)
            row |= agreement(ref, got)
        rows.append(row)
    return nbytes, rows


def table(rows: list[dict]) -> str:
    lines = ["| path | impl | ms | wall ms | GB/s | x copy | GPU busy ms | top kernel GB/s "
             "| fingerprints |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['path']} | skipped: {r['skipped']} |||||||")
            continue
        same = ("" if "agree" not in r else
                f"{r['fingerprints']}, same as {r['same_as']}" if r["agree"] else
                f"DIFFER from {r['same_as']} at {r['first_difference']}")
        lines.append(f"| {r['path']} | {r.get('impl', '')} | {r['ms']} | {r['wall_ms']} | "
                     f"{r['gbs']} | {r['vs_copy']} | {r.get('busy_ms')} | "
                     f"{r.get('top_kernel_gbs', '')} | {same} |")
    return "\n".join(lines)


def _paths(text: str) -> list[str]:
    paths = [s.strip() for s in text.split(",") if s.strip()]
    if not paths or any(p not in PATHS for p in paths) or len(set(paths)) < len(paths):
        raise SystemExit(f"--paths {text!r}: choose from {', '.join(PATHS)}, comma-separated")
    return paths


def _configs(text: str) -> list[str]:
    """``BxIxW`` kernel configurations: power-of-two block and warps, ``B * I`` at most the
    fingerprint's position modulus (the kernel's one residue per program)."""
    configs = [s.strip() for s in text.split(",") if s.strip()]
    for cfg in configs:
        parts = cfg.split("x")
        ok = len(parts) == 3 and all(p.isdigit() and int(p) > 0 for p in parts)
        b, i, w = (int(p) for p in parts) if ok else (0, 0, 0)
        if not (ok and b & (b - 1) == 0 and w in (1, 2, 4, 8, 16, 32) and b * i <= 1_000_003):
            raise SystemExit(f"--configs {text!r}: each is BLOCKxITERSxWARPS, a power-of-two "
                             "block, 1-32 warps, BLOCK * ITERS <= 1,000,003 (e.g. 2048x8x8)")
    return configs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="fp8", help="a format the direct sync writes")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=None, help="default: the model's 128")
    p.add_argument("--tiny", action="store_true",
                   help="small widths (hidden 256, vocabulary 1024): a smoke run")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-profile", action="store_true", help="skip the profiled pass")
    p.add_argument("--configs", default="",
                   help="kernel BLOCKxITERSxWARPS to time as well, e.g. 2048x8x8,1024x8x4")
    p.add_argument("--out", type=Path, default=None, help="JSONL file the rows are appended to")
    a = p.parse_args(argv)
    paths, configs = _paths(a.paths), _configs(a.configs)
    cfg = (tiny_config if a.tiny else model_config)(a.layers, a.experts)
    dev = torch.device(a.device)
    head = {"bench": "fingerprint_speed", "commit": commit(), "device":
            torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "cpu_numbers": dev.type != "cuda", "format": a.format, "layers": a.layers,
            "experts": cfg["num_experts"], "tiny": a.tiny, "repeats": a.repeats,
            "warmup": a.warmup}
    nbytes, rows = bench(cfg, a.format, a.device, paths, a.repeats, a.warmup,
                         not a.no_profile, configs)
    head["bytes"] = nbytes
    rows = [head | r for r in rows]
    append_records(a.out, rows)
    print(f"[fingerprint_speed] {a.format}, {a.layers} layers x {cfg['num_experts']} experts"
          f"{' (tiny widths)' if a.tiny else ''}: {head['bytes'] / 1e9:.3f} GB fingerprinted "
          f"on {head['device']} (commit {head['commit']}, median of {a.repeats})")
    if head["cpu_numbers"]:
        print("[fingerprint_speed] CPU numbers: they say that the script works, not how fast "
              "a GPU fingerprints")
    print(table(rows))
    return 0 if all(r.get("agree", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
