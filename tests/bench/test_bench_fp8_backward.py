"""bench/fp8_backward.py runs on the CPU: one row per gradient and element type, the speed A/B
refused without CUDA with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_backward.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_fp8_backward_bench_cpu(tmp_path):
    out = tmp_path / "fp8_backward.jsonl"
    proc = _run("--kinds", "moe", "--quiet", "--batch", "2", "--seq", "32", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    grads = [r for r in rows if r["what"] == "gradient"]
    assert {r["grad_fp8"] for r in grads} == {"e4m3", "e5m2"}
    params = {r["param"] for r in grads}
    assert "<input>" in params and "decoder.layers.0.mlp.experts.linear_fc1.weight" in params
    assert all(0.99 < r["cosine"] <= 1.0 + 1e-12 for r in grads)
    assert {(r["gemms"], r["grad_fp8"]) for r in grads} == {
        ("dgrad", "e4m3"), ("dgrad", "e5m2"), ("wgrad", "e4m3"), ("wgrad", "e5m2"),
        ("dgrad+wgrad", "e4m3")}
    # E5M2 (one mantissa bit fewer) is the farther of the two at the input gradient
    inp = {r["grad_fp8"]: r["rel_l2"] for r in grads
           if r["param"] == "<input>" and r["gemms"] == "dgrad"}
    assert 0 < inp["e4m3"] < inp["e5m2"]
    # the FP8 wgrad alone leaves the input gradient as it was, and changes the experts' dW
    wgrad = {r["param"]: r["rel_l2"] for r in grads if r["gemms"] == "wgrad"
             and r["grad_fp8"] == "e4m3"}
    assert wgrad["<input>"] == 0 and wgrad["decoder.layers.0.mlp.experts.linear_fc1.weight"] > 0
    assert "moe dgrad e4m3: input gradient cos" in proc.stdout
    assert "moe wgrad e4m3: input gradient cos 1.000000" in proc.stdout


def test_fp8_backward_bench_refusals():
    bad = _run("--kinds", "dense,gpt")
    assert bad.returncode == 2 and "--kinds: unknown ['gpt']" in bad.stdout
    if not torch.cuda.is_available():
        speed = _run("--speed-only")
        assert speed.returncode == 2 and "--speed-only needs CUDA" in speed.stdout
