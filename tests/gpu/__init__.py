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


def skip_unless_compiled_triton() -> None:
    """Skip the calling test module unless a CUDA GPU and Triton's compiler are present (not
    its interpreter: ``TRITON_INTERPRET=1`` would run the CPU tests' mode)."""
    import os

    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 runs the interpreter, not the compiled kernels",
                    allow_module_level=True)
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton does not import (torch's CUDA wheels ship it)",
                    allow_module_level=True)


def run_json_worker(script: str, args: list[str], out, done_key: str, what: str,
                    timeout: int = 900, tail: int = 40) -> dict:
    """Run ``script`` (a test file's ``__main__`` worker: one SGLang engine in its own process)
    with ``args`` from the repository root; it writes its JSON result to ``out``. Asserts the
    worker exited 0 and wrote ``done_key``; returns the result.

    The worker's stdout and stderr (its SGLang schedulers' too) are echoed as they come and
    the last ``tail`` lines go into the failure message, so a failed case reports its own
    traceback even where only pytest's summary or a grep of it comes back (bench/h200.sh)."""
    import json
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    rc, last, killed = _run_echoed([sys.executable, str(script), *args], env, root, timeout,
                                   tail)
    res = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
    if rc == 0 and done_key in res:
        return res
    why = f"killed after {timeout} s" if killed else f"exit {rc}"
    lines = "\n".join(f"  worker| {ln}" for ln in last)
    raise AssertionError(f"{what} failed ({why}); partial result: {res}\n"
                         f"  worker| --- its last {len(last)} output lines ---\n{lines}")


def _run_echoed(cmd: list[str], env: dict, cwd, timeout: int,
                tail: int) -> tuple[int, list[str], bool]:
    """``cmd``'s exit status, its last ``tail`` output lines (stdout + stderr, each cut to 400
    characters) and whether it was killed at ``timeout``; its output echoed to sys.stdout."""
    import collections
    import subprocess
    import sys
    import threading

    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    last: collections.deque[str] = collections.deque(maxlen=tail)

    def pump() -> None:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                last.append(line.rstrip()[-400:])

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    killed = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc, killed = proc.wait(), True
    reader.join(timeout=30)  # engine subprocesses that outlive the worker keep the pipe open
    return rc, list(last), killed
