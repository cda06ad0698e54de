"""H200 test: SGLang 0.5.17 loads every QuantSpec export and matches the aligned reference.

Skipped (with the reason) where CUDA or sglang is missing, i.e. everywhere but the GPU
machine. Runs :mod:`sglang_load_check` in a subprocess (each engine in its own process)
and checks its ``results.json``. Select formats with ``QRL_SGLANG_FORMATS=int8,fp8``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (SGLang engine); run on the H200 machine"
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not importable (pip install -e .[gpu], or the H200 recipe site dir)"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_sglang_loads_every_format_and_matches_reference(tmp_path):
    formats = os.environ.get("QRL_SGLANG_FORMATS", "bf16,int8,fp8,fp8_block,w4a16,nvfp4")
    cmd = [sys.executable, str(HERE / "sglang_load_check.py"), "--out", str(tmp_path),
           "--work", str(tmp_path / "work"), "--formats", formats, "--prewarm"]
    subprocess.run(cmd, check=True, timeout=900)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    failed = [(r["model"], r["format"], r["engine"].get("error")) for r in rows
              if not r["engine"].get("ok")]
    assert not failed, f"engines that did not start or generate: {failed}"
    for r in rows:
        ref = r["ref"]
        assert "ref_error" not in ref, ref.get("ref_error")
        al, plain = ref["aligned"], ref["bf16_ref"]
        where = f"{r['model']}/{r['format']}"
        # the engine must follow the reference built from the same packed tensors
        assert al["greedy_agree"] >= 0.9, (where, al)
        assert al["mean_abs_dlogprob"] <= 0.05, (where, al)
        if r["format"] != "bf16":
            # and that reference must explain the engine better than the unquantized model
            assert al["mean_abs_dlogprob"] < plain["mean_abs_dlogprob"], (where, al, plain)
