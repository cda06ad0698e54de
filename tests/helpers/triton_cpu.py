"""The fused Triton kernels on a CPU: run by Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton loads), or compiled for sm_90 without a GPU to read their PTX (in a fresh process
where ``TRITON_INTERPRET`` is unset). Triton is not in the shared venv (installed aside, e.g.
``pip install --target /tmp/triton_site triton``, then ``PYTHONPATH=/tmp/triton_site:$PWD``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def require_triton_interpreter(gpu_test: str) -> None:
    """Set ``TRITON_INTERPRET=1`` and import Triton, or skip the calling test module with the
    reason (Triton missing: ``gpu_test`` covers the kernels; Triton already loaded without the
    interpreter by another module)."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 could be set (by another "
                    "test module, e.g. through ModelOpt): run this module in its own pytest "
                    "process", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip(f"triton not installed (CPU CI): GPU test {gpu_test} covers it",
                    allow_module_level=True)


def _sm90(fn, sig: dict[str, str], values: tuple, num_warps: int, divisible: tuple[str, ...]):
    """Kernel ``fn`` compiled for sm_90 (signature ``sig``; ``values`` of its constexprs in
    order; the arguments named in ``divisible`` specialized as divisible by 16, as Triton's JIT
    specializes such pointers and integers)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(sig)
    first = names.index(next(k for k, v in sig.items() if v == "constexpr"))
    consts = {(first + i,): v for i, v in enumerate(values)}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in divisible}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def _counts(ops: list[str]) -> dict[str, int]:
    return {op: ops.count(op) for op in sorted(set(ops))}


def sm90_ptx_counts(fn, sig: dict[str, str], values: tuple, pattern: str, num_warps: int = 4,
                    divisible: tuple[str, ...] = ()) -> dict[str, int]:
    """Compile kernel ``fn`` for sm_90 (:func:`_sm90`) and count the PTX instructions
    ``pattern`` finds."""
    k = _sm90(fn, sig, values, num_warps, divisible)
    return _counts(re.findall(pattern, k.asm["ptx"]))


def sm90_sass_counts(fn, sig: dict[str, str], values: tuple, num_warps: int = 4,
                     divisible: tuple[str, ...] = ()) -> dict[str, int]:
    """Compile kernel ``fn`` for sm_90 (:func:`_sm90`) and count its machine instructions
    (SASS, disassembled by the tools Triton ships, no GPU needed) by opcode without modifiers
    (``LDL`` for ``LDL.LU``: a local-memory load, i.e. a spilled register read back)."""
    k = _sm90(fn, sig, values, num_warps, divisible)
    # Triton's listing: "<control codes>\t[@predicate ]OPCODE[.modifiers] operands;"
    return _counts(re.findall(r"^\S+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", k.asm["sass"],
                              re.M))


def run_ptx_script(script: str) -> dict:
    """The JSON object that ``script`` (relative to the repository root) prints last, run in a
    fresh process without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / script)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
