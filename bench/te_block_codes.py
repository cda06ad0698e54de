#!/usr/bin/env python3
"""TE's FP8 block quantizer against the ``fp8_block`` spec, element by element (H200).

    python bench/te_block_codes.py --out $OUT/te_block_codes.jsonl

For 128x128 weight blocks and 1x128 activation groups, compares what each side actually
stores — the E4M3 codes and the fp32 dequantization scales (``scale_inv``) — not the
dequantized values (TE's ``dequantize()`` returns the input's dtype, BF16, which rounds
``code * scale_inv`` again). Prints, per tensor: the share of codes that differ, of scales
that differ in any bit, the largest code distance in E4M3 steps, and the first differing
elements with the input value, both scales and both codes. Also reports whether the
``Float8BlockScaling`` recipe object a process gets has power-of-two scales on: TE reads
``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` once, when ``transformer_engine.common.recipe`` is
first imported (a class attribute), so setting it later changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PROBE = ("import os, sys; {pre}import transformer_engine.common.recipe as r; {post}"
         "print(r.Float8BlockScaling().fp8_quant_fwd_weight.power_2_scale)")


def pow2_when(env_before_import: bool) -> bool:
    """``power_2_scale`` of a new ``Float8BlockScaling()`` when the env variable is set
    before / after TE's recipe module is imported (a fresh interpreter each)."""
    set_env = "os.environ['NVTE_FP8_BLOCK_SCALING_FP32_SCALES'] = '1'; "
    code = PROBE.format(pre=set_env if env_before_import else "",
                        post="" if env_before_import else set_env)
    env = {k: v for k, v in os.environ.items() if k != "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] == "True"


def te_codes(x, dim: int):
    """TE's (codes as float8, scale_inv fp32) of ``x`` for ``dim``-D blocks, fp32 scales."""
    import torch
    import transformer_engine.pytorch  # noqa: F401  (loads transformer_engine_torch)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    q = Float8BlockQuantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                             amax_epsilon=0.0, force_pow_2_scales=False, block_scaling_dim=dim)(x)
    return q._rowwise_data.view(torch.float8_e4m3fn), q._rowwise_scale_inv


def ref_codes(x, dim: int):
    """The spec's (codes, scale_inv) — ``fp8_block``'s weight quantizer (2-D) or its
    activation rule (1x128 groups, SGLang ``per_token_group_quant_fp8``)."""
    import torch

    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.numerics import FP8_E4M3_MAX, cast_e4m3

    if dim == 2:
        q = get_spec("fp8_block").quantize_weight(x)
        return q.codes, q.scale
    g = x.float().reshape(x.shape[0], -1, 128)
    a = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10)
    codes = cast_e4m3(g * (FP8_E4M3_MAX / a)).reshape(x.shape)
    return codes, (a * (1.0 / FP8_E4M3_MAX)).reshape(x.shape[0], -1).to(torch.float32)


def compare(name: str, x, dim: int) -> dict:
    """Codes and scales of TE vs the spec for ``x`` (see module docstring)."""
    import torch

    tc, ts = te_codes(x, dim)
    rc, rs = ref_codes(x, dim)
    ts = ts.float()
    if ts.shape[0] < rs.shape[0]:  # TE keeps 1x128 scales as [groups, tokens] (padded)
        ts = ts.t()
    ts = ts[: rs.shape[0], : rs.shape[1]]  # and pads its scale arrays
    tcf, rcf = tc.float(), rc.float()
    codes_differ = tcf != rcf
    scale_bits_differ = ts.view(torch.int32) != rs.float().view(torch.int32)
    # E4M3 steps between the codes: index distance in the ordered code set
    ti = tc.view(torch.uint8).to(torch.int32)
    ri = rc.view(torch.uint8).to(torch.int32)
    mag = lambda i: (i & 0x7F) * torch.where(i & 0x80 > 0, -1, 1)  # noqa: E731
    steps = (mag(ti) - mag(ri)).abs()
    rec = {"tensor": name, "shape": list(x.shape), "block_dim": dim,
           "codes_differ": round(codes_differ.float().mean().item(), 6),
           "scales_differ": round(scale_bits_differ.float().mean().item(), 6),
           "max_code_steps": int(steps.max().item()),
           "scale_rel_max": float(((ts - rs.float()).abs() / rs.float()).max().item())}
    idx = codes_differ.nonzero()[:5].tolist()
    rows = 128 if dim == 2 else 1
    rec["examples"] = [{
        "at": i, "x": float(x[i[0], i[1]]), "te_code": float(tcf[i[0], i[1]]),
        "ref_code": float(rcf[i[0], i[1]]),
        "te_scale_inv": float(ts[i[0] // rows, i[1] // 128]),
        "ref_scale_inv": float(rs[i[0] // rows, i[1] // 128]),
        "x_times_ref_scale": float(x[i[0], i[1]].double() / rs[i[0] // rows, i[1] // 128].double())}
        for i in idx]
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch
    from _runner import commit

    recs = [{"probe": "power_2_scale", "env_before_import": pow2_when(True),
             "env_after_import": pow2_when(False), "commit": commit()}]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(2048, 768, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(512, 2048, device="cuda", generator=g).bfloat16()
    recs += [compare("weight_bf16", w, 2), compare("activation_bf16", x, 1),
             compare("weight_fp32", w.float(), 2), compare("activation_fp32", x.float(), 1)]
    for r in recs:
        r.setdefault("commit", recs[0]["commit"])
        print("[te_block_codes] " + json.dumps(r), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
