"""Compile the fused quantizers for sm_90 without a GPU and count PTX instructions (run as a
script in a fresh process: ``TRITON_INTERPRET`` must be unset when Triton loads).

Prints one JSON object ``{kernel: {instruction: count}}`` (tests/quant/test_fused_ptx.py)."""

from __future__ import annotations

import json

from megatron_qrl.quant import triton_act as ta
from megatron_qrl.quant import triton_quant as tq
from tests.helpers.triton_cpu import sm90_ptx_counts

EPS = 2.0**-24
_OUT = {"codes_ptr": "*u8", "scale_ptr": "*fp32", "amax_ptr": "*fp32"}
_CHANNEL = {"w_ptr": "*bf16", **_OUT, "n_rows": "i32", "k": "i32",
            **{s: "i32" for s in ("sw_e", "sw_r", "sc_e", "sc_r", "ss_e", "ss_r")},
            "MAXV": "constexpr", "INT8": "constexpr", "EPS": "constexpr", "SOFT": "constexpr",
            "BLOCK_R": "constexpr", "BLOCK_K": "constexpr"}
KERNELS = {
    "fp8": (tq._channel_into_kernel, _CHANNEL, (448.0, False, EPS, False, 4, 2048)),
    "int8": (tq._channel_into_kernel, {**_CHANNEL, "codes_ptr": "*i8"},
             (127.0, True, EPS, False, 4, 2048)),
    "fp8_block": (tq._fp8_block_kernel, {"w_ptr": "*bf16", **_OUT, "n": "i32", "k": "i32",
                                         "stride_w": "i32", "kb": "i32", "EPS": "constexpr",
                                         "SOFT": "constexpr", "BLOCK": "constexpr"},
                  (EPS, False, 128)),
    "fp8_block_into": (tq._fp8_block_into_kernel,
                       {"w_ptr": "*bf16", **_OUT, "n": "i32", "k": "i32", "kb": "i32",
                        **{s: "i32" for s in ("sw_e", "sw_r", "sc_e", "sc_r", "ss_e", "ss_r",
                                              "ss_c")},
                        "EPS": "constexpr", "SOFT": "constexpr", "BLOCK": "constexpr"},
                       (EPS, False, 128)),
    "w4a16": (tq._w4a16_kernel, {"w_ptr": "*bf16", "codes_ptr": "*i8", "packed_ptr": "*i32",
                                 "scale_ptr": "*bf16", "amax_ptr": "*fp32", "n_rows": "i32",
                                 "k": "i32", "stride_w": "i32", "EPS": "constexpr",
                                 "BLOCK_R": "constexpr", "GROUP": "constexpr"}, (EPS, 16, 128)),
    "nvfp4": (tq._nvfp4_kernel, {"w_ptr": "*bf16", "s2_ptr": "*fp32", "s2_stride": "i32",
                                 "codes_ptr": "*u8", "packed_ptr": "*u8", "scale_ptr": "*u8",
                                 "amax_ptr": "*fp32", "n_rows": "i32", "k": "i32",
                                 "stride_w": "i32", "SOFT": "constexpr", "BLOCK_R": "constexpr",
                                 "NB": "constexpr", "BLOCK": "constexpr"}, (False, 16, 8, 16)),
}
_ACT = {"x_ptr": "*i16", "codes_ptr": "*u8", "scale_ptr": "*fp32", "n_rows": "i32", "k": "i32",
        "stride_x": "i32", "inv_max": "fp32", "INT8": "constexpr", "CUDA_DIV": "constexpr",
        "BF16_BITS": "constexpr", "SOFT": "constexpr", "BLOCK_R": "constexpr",
        "BLOCK_K": "constexpr"}
_DEQ = {"codes_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*bf16", "n_rows": "i32",
        "k": "i32", "FP8": "constexpr", "BF16_SOFT": "constexpr", "SOFT": "constexpr",
        "BLOCK_R": "constexpr", "BLOCK_K": "constexpr"}
KERNELS.update({  # the real GEMM's operand kernels (triton_act), as CUDA runs them
    "act_fp8": (ta._act_token_kernel, _ACT, (False, True, True, False, 2, 4096)),
    "act_int8": (ta._act_token_kernel, {**_ACT, "codes_ptr": "*i8"},
                 (True, True, True, False, 2, 4096)),
    "dequant_fp8": (ta._dequant_rows_kernel, _DEQ, (True, False, False, 16, 256)),
    "dequant_int8": (ta._dequant_rows_kernel, {**_DEQ, "codes_ptr": "*i8"},
                     (False, False, False, 16, 256)),
})


def ptx_counts(name: str) -> dict[str, int]:
    fn, sig, values = KERNELS[name]
    return sm90_ptx_counts(fn, sig, values, r"\b((?:fma|div|rcp|cvt|mul|add)\.[a-z0-9.]+)")


if __name__ == "__main__":
    print(json.dumps({name: ptx_counts(name) for name in KERNELS}))
