"""Compile the fingerprint kernel for sm_90 without a GPU and print its PTX counts (JSON):
the integer atomics, the word loads, the 64-bit and widening multiplies (run by tests/sync/test_checksums_ptx.py in a fresh
process without ``TRITON_INTERPRET``)."""

import json

from megatron_qrl.sync.protocol.triton_checksums import BLOCK, ITERS, _segment_sums_kernel
from tests.helpers.triton_cpu import sm90_ptx_counts

SIG = {"words_ptr": "*i32", "table_ptr": "*i64", "starts_ptr": "*i64", "lens_ptr": "*i64",
       "out_ptr": "*i64", "BLOCK": "constexpr", "ITERS": "constexpr", "MOD": "constexpr"}
print(json.dumps(sm90_ptx_counts(_segment_sums_kernel, SIG, (BLOCK, ITERS, 1_000_003),
                                 r"atom\.global\.[a-z0-9._]+|ld\.global\.[a-z0-9.]+"
                                 r"|m(?:ul|ad)\.(?:hi|lo|wide)\.[su](?:32|64)")))
