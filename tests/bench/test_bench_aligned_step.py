"""bench/aligned_step.py --tiny runs on the CPU and reports every variant it could build."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_aligned_step_tiny_cpu(tmp_path):
    out = tmp_path / "aligned.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "aligned_step.py"), "--tiny", "--warmup", "1",
         "--rounds", "2", "--formats", "int8,fp8,fp8_block,nvfp4", "--per-expert", "int8", "--real", "fp8,int8",
         "--real-torch-operands", "--real-fp8-backward", "--out", str(out)],
        capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    names = [r["variant"] for r in recs]
    # hidden 64 is not a multiple of fp8_block's 128-wide activation groups: skipped, said so
    assert names == ["bf16", "bf16:off", "aligned:int8", "aligned:fp8", "aligned:nvfp4",
                     "aligned:int8:per-expert", "aligned:fp8:real", "aligned:fp8:real:bwd8",
                     "aligned:fp8:real:bwd8:torch", "aligned:fp8:real:torch",
                     "aligned:int8:real", "aligned:int8:real:torch"]
    assert [r["path"] for r in recs][-6:] == ["real GEMM", "real GEMM, FP8 backward",
                                              "real GEMM, FP8 backward, torch operands",
                                              "real GEMM, torch operands", "real GEMM",
                                              "real GEMM, torch operands"]
    assert [r["quant_impl"] for r in recs][-6:] == ["auto", "auto", "torch", "torch", "auto",
                                                    "torch"]
    assert [r["backward"] for r in recs][-6:] == ["bf16/bf16", "fp8/fp8", "fp8/fp8",
                                                  "bf16/bf16", "bf16/bf16", "bf16/bf16"]
    assert any("aligned:fp8_block skipped" in n for n in recs[0]["notes"])
    for r in recs:
        assert len(r["times_s"]) == 2
        assert all(math.isfinite(t) and t > 0 for t in r["times_s"])
        assert math.isfinite(r["ratio_to_baseline"]) and r["ratio_to_baseline"] > 0
        assert r["baseline"] == "bf16" and r["device"] == "cpu" and r["commit"]
        assert math.isfinite(r["mfu"]) and r["mfu"] >= 0
    assert recs[0]["ratio_to_baseline"] == 1.0
    table = proc.stdout[proc.stdout.index("| variant |"):]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in rows] == names
    for row, r in zip(rows, recs):
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert float(cells[2]) == round(r["median_step_s"], 4)
        assert float(cells[3]) == round(r["ratio_to_baseline"], 3)
        assert float(cells[4]) == round(r["mfu"], 3) and cells[5] == "n/a"


def test_real_refused_for_a_format_without_real_gemm():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "aligned_step.py"), "--tiny", "--formats",
         "fp8_block", "--real", "fp8_block"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--real fp8_block: --qrl-train-aligned-gemm real: fp8_block" in proc.stderr
