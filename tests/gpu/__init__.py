"""GPU tests: run on the H200 device machine, skipped elsewhere with the reason."""

from __future__ import annotations


def skip_unless_sglang_gpu(what: str) -> None:
    """Skip the calling test module unless a CUDA GPU and an importable SGLang are present."""
    import pytest
    import torch

    from megatron_qrl.utils.optional import available

    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA GPU: {what} run on the H200 device only", allow_module_level=True)
    ok, why = available("sglang")
    if not ok:
        pytest.skip(f"SGLang not importable here ({why})", allow_module_level=True)


def run_json_worker(script: str, args: list[str], out, done_key: str, what: str,
                    timeout: int = 900) -> dict:
    """Run ``script`` (a test file's ``__main__`` worker: one SGLang engine in its own process)
    with ``args`` from the repository root; it writes its JSON result to ``out``. Asserts the
    worker exited 0 and wrote ``done_key``; returns the result."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), *args], env=env, cwd=root,
                          timeout=timeout)
    res = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
    assert proc.returncode == 0 and done_key in res, (
        f"{what} failed (exit {proc.returncode}; its SGLang log and traceback are in the output "
        f"above); partial result: {res}")
    return res
