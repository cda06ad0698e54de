#!/usr/bin/env python3
"""H200 check: SGLang loads every QuantSpec export, and its log-probs match our reference.

    python tests/gpu/sglang_load_check.py --out OUT [--formats bf16,int8,...] [--models moe,dense]

For each tiny random model (Qwen3-MoE and dense Qwen3) and each format: export with
:func:`megatron_qrl.models.export.export_quantized`, start ``sglang.Engine`` on the directory
in its own process (:mod:`sglang_engine_worker`, with a timeout), greedy-generate 16 tokens
for 4 random prompts with per-token log-probs, then teacher-force those tokens through
(a) the aligned reference (weights dequantized from the same exported tensors, activation
fake quant for W8A8 formats; bf16 and fp32) and (b) the unquantized bf16 model. Writes
``results.json`` and ``results.md`` to OUT. Needs CUDA and sglang; nothing is downloaded.
Marlin formats (w4a16, nvfp4) JIT-compile kernels on first use; ``--prewarm`` compiles the
three modules in parallel up front (cache: ``$TVM_FFI_CACHE_DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1] if (HERE.parents[1] / "megatron_qrl").is_dir() else Path.cwd()
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

MARLIN = ("w4a16", "nvfp4")
PREWARM = {
    "gptq_marlin": "from sglang.kernels.ops.quantization.gptq_marlin import "
                   "_jit_gptq_marlin_module as f; f(torch.bfloat16)",
    "gptq_marlin_repack": "from sglang.kernels.ops.quantization.gptq_marlin_repack import "
                          "_jit_gptq_marlin_repack_module as f; f()",
    "moe_wna16_marlin": "from sglang.kernels.ops.moe.moe_wna16_marlin import "
                        "_jit_moe_wna16_marlin_module as f; f(torch.bfloat16, False, False)",
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_prompts(seed: int = 0) -> list[list[int]]:
    from sglang_reference import VOCAB

    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (8, 13, 21, 32)]


def export_all(root: Path, models: list[str], formats: list[str]) -> dict:
    """Build the tiny models and export every format; returns {(model, fmt): dir or error}."""
    from sglang_reference import build_tiny

    from megatron_qrl.models.export import export_quantized

    dirs: dict = {}
    for kind in models:
        base = build_tiny(kind, root / f"{kind}-base")
        for fmt in formats:
            try:
                dirs[(kind, fmt)] = export_quantized(base, fmt, root / f"{kind}-{fmt}",
                                                     overwrite=True, progress=False)
            except Exception as exc:  # noqa: BLE001 - reported per format
                dirs[(kind, fmt)] = f"export failed: {type(exc).__name__}: {exc}"
    return dirs


def start_worker(kind: str, fmt: str, mdir: Path, work: Path, port: int, args) -> dict:
    out = work / f"engine-{kind}-{fmt}.json"
    logf = work / f"engine-{kind}-{fmt}.log"
    cmd = [sys.executable, str(HERE / "sglang_engine_worker.py"), "--model-dir", str(mdir),
           "--prompts", str(work / "prompts.json"), "--out", str(out), "--port", str(port),
           "--max-new", str(args.max_new), "--mem-fraction", str(args.mem_fraction)]
    fh = open(logf, "w")  # noqa: SIM115 - closed in finish_worker
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    log(f"start engine {kind}/{fmt} pid {proc.pid}")
    return {"kind": kind, "fmt": fmt, "proc": proc, "fh": fh, "out": out, "log": logf,
            "t0": time.time()}


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish_worker(job: dict, timed_out: bool) -> dict:
    if timed_out:
        kill_group(job["proc"])
    job["proc"].wait()
    job["fh"].close()
    kill_group(job["proc"])  # leftover scheduler / detokenizer children
    res = json.loads(job["out"].read_text()) if job["out"].is_file() else {"ok": False}
    res["wall_s"] = round(time.time() - job["t0"], 1)
    if timed_out and not res.get("ok"):
        res["error"] = f"timed out after {res['wall_s']} s"
    if not res.get("ok"):
        res["log_tail"] = error_excerpt(job["log"].read_text(errors="replace"))
    log(f"engine {job['kind']}/{job['fmt']}: ok={res.get('ok')} {res.get('error', '')[:300]}")
    return res


def error_excerpt(text: str, n: int = 60) -> str:
    """Every error line of a log (the scheduler's own traceback included) + the last traceback."""
    lines = text.splitlines()
    errs = [ln for ln in lines if re.search(r"Error|Exception|assert|Traceback", ln)]
    seen: list[str] = []
    for ln in errs:
        if ln not in seen:
            seen.append(ln)
    i = text.rfind("Traceback (most recent call last)")
    tb = (text[i:] if i >= 0 else text).splitlines()
    tb = tb[:n] + (["..."] + tb[-15:] if len(tb) > n else [])
    return "\n".join(["-- error lines --", *seen[:40], "-- last traceback --", *tb])


def run_engines(dirs: dict, work: Path, args, deadline: float) -> dict:
    """Run one engine process per exported dir; Marlin formats first, bounded concurrency."""
    todo = sorted([k for k, v in dirs.items() if isinstance(v, Path)],
                  key=lambda k: (k[1] not in MARLIN, k[0] != "moe"))
    running: list[dict] = []
    results: dict = {}
    port = 31000
    while todo or running:
        n_fast = sum(1 for j in running if j["fmt"] not in MARLIN)
        for k in list(todo):
            if k[1] in MARLIN or n_fast < args.parallel:
                todo.remove(k)
                running.append(start_worker(k[0], k[1], dirs[k], work, port, args))
                port += 50
                n_fast += k[1] not in MARLIN
        time.sleep(1.0)
        now = time.time()
        for j in list(running):
            limit = args.marlin_timeout if j["fmt"] in MARLIN else args.engine_timeout
            over = now - j["t0"] > limit or now > deadline
            if j["proc"].poll() is not None or over:
                running.remove(j)
                results[(j["kind"], j["fmt"])] = finish_worker(j, over)
    return results


def references(dirs: dict, engines: dict, prompts, models: list[str], device: str = "cuda") -> dict:
    """Teacher-forced reference metrics for each engine run that produced tokens."""
    import torch
    from sglang_reference import aligned_model, compare, load_model, teacher_force

    from megatron_qrl.models.hf_io import HFCheckpointReader
    from megatron_qrl.quant import get_spec

    out: dict = {}
    for kind in models:
        base_dir = Path(dirs[(kind, "bf16")]).parent / f"{kind}-base"
        base = load_model(base_dir, device)
        names = HFCheckpointReader(base_dir).names()
        for (k, fmt), eng in engines.items():
            if k != kind or not eng.get("ok"):
                continue
            spec = get_spec(fmt)
            row: dict = {}
            try:
                row["bf16_ref"] = compare(eng, *teacher_force(base, prompts, eng["output_ids"]))
                tf = {}
                for tag, dt in (("aligned", torch.bfloat16), ("aligned_fp32", torch.float32)):
                    m = aligned_model(base, dirs[(k, fmt)], spec, names, dtype=dt)
                    tf[tag] = teacher_force(m, prompts, eng["output_ids"])
                    row[tag] = compare(eng, *tf[tag])
                    row["n_dequantized"] = m._qrl_n_dequantized
                    del m
                # the same reference in bf16 vs fp32: how far rounding noise alone moves it
                # (dynamic activation quantization amplifies it; weight-only formats do not)
                as_engine = {"output_ids": eng["output_ids"], "output_logprobs": tf["aligned"][0]}
                row["aligned_bf16_vs_fp32"] = compare(as_engine, *tf["aligned_fp32"])
            except Exception as exc:  # noqa: BLE001 - reported per format
                import traceback

                row["ref_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            out[(k, fmt)] = row
        del base
        torch.cuda.empty_cache()
    return out


def prewarm(work: Path) -> list:
    """Compile SGLang's three Marlin JIT modules in parallel processes (shared file cache)."""
    procs = []
    for name, code in PREWARM.items():
        fh = open(work / f"prewarm-{name}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, "-c", f"import torch, time; t = time.time(); {code}; "
               f"print('PREWARM_DONE {name}', round(time.time() - t, 1), flush=True)"]
        procs.append((name, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                             start_new_session=True), fh, time.time()))
    log(f"prewarm started: {list(PREWARM)}")
    return procs


def finish_prewarm(procs: list) -> dict:
    out = {}
    for name, proc, fh, t0 in procs:
        rc = proc.poll()
        if rc is None:
            kill_group(proc)
            proc.wait()
        fh.close()
        out[name] = {"rc": rc, "s": round(time.time() - t0, 1) if rc is not None else None,
                     "log_tail": Path(fh.name).read_text(errors="replace")[-1500:]}
    return out


def fmt_cell(m: dict | None) -> str:
    if not m:
        return "-"
    return f"{m['greedy_agree']:.3f} / {m['max_abs_dlogprob']:.4f} / {m['mean_abs_dlogprob']:.5f}"


def markdown(rows: list[dict]) -> str:
    head = ("| model | format | engine | start s | aligned bf16: agree / max / mean abs dlogprob "
            "| aligned fp32 | bf16 (unquantized) ref | aligned bf16 vs aligned fp32 |\n"
            "|---|---|---|---|---|---|---|---|\n")
    body = ""
    for r in rows:
        status = "ok" if r["engine"].get("ok") else "FAILED"
        ref = r.get("ref", {})
        body += (f"| {r['model']} | {r['format']} | {status} | {r['engine'].get('startup_s', '-')} "
                 f"| {fmt_cell(ref.get('aligned'))} | {fmt_cell(ref.get('aligned_fp32'))} "
                 f"| {fmt_cell(ref.get('bf16_ref'))} | {fmt_cell(ref.get('aligned_bf16_vs_fp32'))} |\n")
    errs = ""
    for r in rows:
        e = r["engine"]
        if not e.get("ok") or r.get("ref", {}).get("ref_error"):
            errs += (f"\n### {r['model']} / {r['format']}\n```\n{e.get('error', '')}\n"
                     f"{e.get('log_tail', '')}\n{r.get('ref', {}).get('ref_error', '')}\n```\n")
    return head + body + errs


def main() -> int:
    from megatron_qrl.quant import list_specs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results directory (results.json, results.md)")
    p.add_argument("--work", default="/tmp/qrl_sglang_check", help="models and logs")
    p.add_argument("--formats", default=",".join(list_specs()))
    p.add_argument("--models", default="moe,dense")
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--parallel", type=int, default=4, help="non-Marlin engines at once")
    p.add_argument("--mem-fraction", type=float, default=0.45)
    p.add_argument("--engine-timeout", type=float, default=240)
    p.add_argument("--marlin-timeout", type=float, default=540)
    p.add_argument("--deadline-s", type=float, default=520, help="whole run, then report")
    p.add_argument("--ref-device", default="cuda", help="device of the reference models")
    p.add_argument("--prewarm", action="store_true", help="compile Marlin JIT modules first")
    args = p.parse_args()
    t_start = time.time()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    formats, models = args.formats.split(","), args.models.split(",")
    if "bf16" not in formats:
        formats = ["bf16", *formats]  # the unquantized reference reads the bf16 base dir
    pre = prewarm(work) if args.prewarm and any(f in MARLIN for f in formats) else []
    prompts = make_prompts()
    (work / "prompts.json").write_text(json.dumps(prompts))
    dirs = export_all(work, models, formats)
    log(f"exported {sum(isinstance(v, Path) for v in dirs.values())}/{len(dirs)}")
    engines = run_engines(dirs, work, args, deadline=t_start + args.deadline_s - 45)
    for k, v in dirs.items():
        if not isinstance(v, Path):
            engines[k] = {"ok": False, "error": v}
    (out / "engines.json").write_text(json.dumps({"/".join(k): v for k, v in engines.items()},
                                                 default=str))
    try:
        refs = references(dirs, engines, prompts, models, device=args.ref_device)
    except Exception as exc:  # noqa: BLE001 - keep the engine results
        import traceback

        log(f"references failed: {exc}\n{traceback.format_exc()}")
        refs = {}
    rows = [{"model": k[0], "format": k[1], "engine": engines.get(k, {}), "ref": refs.get(k, {})}
            for k in sorted(engines, key=lambda k: (k[0], formats.index(k[1])))]
    res = {"prompts": prompts, "rows": rows, "prewarm": finish_prewarm(pre),
           "total_s": round(time.time() - t_start, 1)}
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "results.md").write_text(markdown(rows))
    print(markdown(rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
