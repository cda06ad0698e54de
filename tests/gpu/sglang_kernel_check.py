#!/usr/bin/env python3
"""H200 check: SGLang's W8A8 kernels vs QuantSpec numerics on the SAME bf16 input.

    python tests/gpu/sglang_kernel_check.py --out OUT.json

For ``int8`` (``per_token_quant_int8`` + ``int8_scaled_mm``), ``fp8``
(``sglang_per_token_quant_fp8`` + ``fp8_scaled_mm``) and ``fp8_block``
(``per_token_group_quant_fp8`` + ``w8a8_block_fp8_matmul_triton``): the fraction of
dequantized activation values equal to ``spec._act(x)`` bit for bit, and the GEMM output vs
the fp64 product of our dequantized activation and weight (in bf16 ulps of the output).
End-to-end log-prob differences cannot separate a numerics bug from upstream bf16 noise
that dynamic activation rounding amplifies; this check can.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1] if (HERE.parents[1] / "megatron_qrl").is_dir() else Path.cwd()
sys.path.insert(0, str(ROOT))


def _engine_int8(x, q):
    from sgl_kernel import int8_scaled_mm
    from sglang.kernels.ops.quantization.int8_kernel import per_token_quant_int8

    xq, xs = per_token_quant_int8(x)
    out = int8_scaled_mm(xq, q.codes.t(), xs, q.scale, out_dtype=x.dtype, bias=None)
    return xq.float() * xs, out


def _engine_fp8(x, q):
    from sgl_kernel import fp8_scaled_mm
    from sglang.kernels.ops.quantization.fp8_kernel import sglang_per_token_quant_fp8

    xq, xs = sglang_per_token_quant_fp8(x)
    out = fp8_scaled_mm(xq, q.codes.t(), xs, q.scale, out_dtype=x.dtype)
    return xq.float() * xs, out


def _engine_fp8_block(x, q):
    from sglang.kernels.ops.quantization.fp8_kernel import (
        per_token_group_quant_fp8,
        w8a8_block_fp8_matmul_triton,
    )

    xq, xs = per_token_group_quant_fp8(x, 128, column_major_scales=False)
    out = w8a8_block_fp8_matmul_triton(xq, q.codes, xs, q.scale, [128, 128],
                                       output_dtype=x.dtype)
    deq = (xq.float().view(x.shape[0], -1, 128) * xs.unsqueeze(-1)).view(x.shape)
    return deq, out


ENGINE = {"int8": _engine_int8, "fp8": _engine_fp8, "fp8_block": _engine_fp8_block}


def check(fmt: str, tokens: int = 77, n: int = 384, k: int = 512, seed: int = 0) -> dict:
    import torch

    from megatron_qrl.quant import get_spec

    spec = get_spec(fmt)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, k, device="cuda", generator=g).to(torch.bfloat16)
    x[3, 5] = 40.0  # one outlier token
    w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).to(torch.bfloat16)
    q = spec.quantize_weight(w)
    eng_x, out = ENGINE[fmt](x, q)
    ours_x = spec._act(x.float())
    ref = ours_x.double() @ spec.dequantize(q, torch.float32).double().t()
    ulp = (ref.abs().float().to(torch.bfloat16).float() * 2.0**-7).clamp(min=2.0**-133)
    err_ulp = ((out.double() - ref).abs() / ulp.double()).float()
    return {
        "act_equal_frac": float((eng_x == ours_x).float().mean()),
        "act_max_abs_diff": float((eng_x - ours_x).abs().max()),
        "gemm_max_err_bf16_ulp": float(err_ulp.max()),
        "gemm_mean_err_bf16_ulp": float(err_ulp.mean()),
        "gemm_out_vs_ref_rel": float((out.double() - ref).norm() / ref.norm()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--formats", default="int8,fp8,fp8_block")
    args = p.parse_args()
    res = {}
    for fmt in args.formats.split(","):
        try:
            res[fmt] = check(fmt)
        except Exception as exc:  # noqa: BLE001 - reported per format
            import traceback

            res[fmt] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
        print(fmt, json.dumps(res[fmt])[:1500], flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
