"""Compile the fused log-prob kernels for sm_90 without a GPU, specialized as Triton's JIT
specializes them for Qwen3's vocabulary (pointers, row stride and slice width divisible by 16:
151,936 = 16 x 9,496), and count PTX instructions (run as a script in a fresh process:
``TRITON_INTERPRET`` must be unset when Triton loads).

Prints one JSON object ``{kernel: {instruction: count}}`` (tests/losses/test_logprob_ptx.py)."""

from __future__ import annotations

import json

from megatron_qrl.losses import triton_logprobs as kernels
from tests.helpers.triton_cpu import sm90_ptx_counts

_FWD = {"x_ptr": "*bf16", "idx_ptr": "*i64", "m_ptr": "*fp32", "s_ptr": "*fp32",
        "w_ptr": "*fp32", "zy_ptr": "*fp32", "stride": "i32", "V": "i32", "inv_t": "fp32",
        "NEG_START": "constexpr", "BLOCK": "constexpr", "ENTROPY": "constexpr"}
_BWD = {"x_ptr": "*bf16", "out_ptr": "*bf16", "lse_ptr": "*fp32", "g_ptr": "*fp32",
        "tgt_ptr": "*i64", "stride": "i32", "V": "i32", "inv_t": "fp32", "BLOCK": "constexpr"}
KERNELS = {
    "row_stats": (kernels._row_stats_kernel, _FWD, (kernels._NEG_START, kernels.BLOCK, True)),
    "grad_logits": (kernels._grad_kernel, _BWD, (kernels.BLOCK,)),
}


def ptx_counts(name: str) -> dict[str, int]:
    fn, sig, values = KERNELS[name]
    divisible = tuple(k for k, v in sig.items() if v.startswith("*") or k in ("stride", "V"))
    return sm90_ptx_counts(fn, sig, values, r"\b((?:ld|st|mul|mad|ex2)\.[a-z0-9.]+)",
                           num_warps=8, divisible=divisible)


if __name__ == "__main__":
    print(json.dumps({name: ptx_counts(name) for name in KERNELS}))
