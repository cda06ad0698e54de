#!/usr/bin/env python3
"""Compile SGLang's JIT kernels for the 4-bit formats once, in parallel, before engines start.

    python tools/prewarm_sglang_kernels.py            # all: gptq_marlin, repack, moe marlin
    TVM_FFI_CACHE_DIR=/shared/cache python tools/prewarm_sglang_kernels.py --jobs 3

w4a16 (compressed-tensors) and nvfp4 (modelopt_fp4 on Hopper) run Marlin kernels that SGLang
0.5.17 compiles with nvcc on first use — measured on the H200: gptq_marlin 330 s,
moe_wna16_marlin 312 s, gptq_marlin_repack 23 s, one after the other inside the engine's
start. This tool builds them side by side into the tvm-ffi cache (``TVM_FFI_CACHE_DIR``,
default ``~/.cache/tvm-ffi``), so every later engine start on the machine (or on any machine
that shares the cache directory) loads them in seconds. Needs a CUDA GPU (the build targets
its architecture) and SGLang.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

KERNELS = {
    "gptq_marlin_repack": ("sglang.kernels.ops.quantization.gptq_marlin_repack",
                           "_jit_gptq_marlin_repack_module", "()"),
    "gptq_marlin": ("sglang.kernels.ops.quantization.gptq_marlin",
                    "_jit_gptq_marlin_module", "(torch.bfloat16,)"),
    "moe_wna16_marlin": ("sglang.kernels.ops.moe.moe_wna16_marlin",
                         "_jit_moe_wna16_marlin_module", "(torch.bfloat16, False, False)"),
}
"""name -> (module, builder, arguments): BF16 activations, no expert parallelism, no bias —
what the Qwen3 engines of megatron_qrl use."""


def _build_cmd(name: str) -> list[str]:
    mod, fn, args = KERNELS[name]
    code = (f"import time, torch; from {mod} import {fn}; t = time.time(); {fn}{args}; "
            f"print('{name} built in %.0f s' % (time.time() - t), flush=True)")
    return [sys.executable, "-c", code]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help=f"comma list of {', '.join(KERNELS)}")
    a = p.parse_args(argv)
    names = a.kernels.split(",")
    bad = [n for n in names if n not in KERNELS]
    if bad:
        p.error(f"--kernels {','.join(bad)}: unknown; choose from {', '.join(KERNELS)}")
    t0 = time.time()
    procs = {n: subprocess.Popen(_build_cmd(n)) for n in names}
    failed = [n for n, pr in procs.items() if pr.wait() != 0]
    print(f"[prewarm] {len(names) - len(failed)}/{len(names)} kernels ready in "
          f"{time.time() - t0:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
