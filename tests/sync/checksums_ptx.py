"""Compile the fingerprint kernels for sm_90 without a GPU and print their instruction counts
(JSON): in its PTX the integer atomics, the word loads, the 64-bit and widening multiplies; in
its machine code every opcode (``sass LDL`` / ``sass STL``: local-memory loads / stores, i.e.
spilled registers). Run by tests/sync/test_checksums_ptx.py in a fresh process without
``TRITON_INTERPRET``. The segment kernel's counts are the top-level keys, the address
kernel's (``_address_sums_kernel``: segments at byte addresses) are under ``address``."""

import json

from megatron_qrl.sync.protocol.triton_checksums import (
    BLOCK,
    ITERS,
    _address_sums_kernel,
    _segment_sums_kernel,
)
from tests.helpers.triton_cpu import sm90_ptx_counts, sm90_sass_counts

SIG = {"words_ptr": "*i32", "table_ptr": "*i64", "starts_ptr": "*i64", "lens_ptr": "*i64",
       "out_ptr": "*i64", "BLOCK": "constexpr", "ITERS": "constexpr", "MOD": "constexpr"}
ADDRESS_SIG = {"table_ptr": "*i64", "addrs_ptr": "*i64", "lens_ptr": "*i64", "out_ptr": "*i64",
               "BLOCK": "constexpr", "ITERS": "constexpr", "MOD": "constexpr"}
VALUES = (BLOCK, ITERS, 1_000_003)
OPS = (r"atom\.global\.[a-z0-9._]+|ld\.global\.[a-z0-9.]+"
       r"|m(?:ul|ad)\.(?:hi|lo|wide)\.[su](?:32|64)")


def counts(kernel, sig):
    sass = sm90_sass_counts(kernel, sig, VALUES)
    return sm90_ptx_counts(kernel, sig, VALUES, OPS) | {f"sass {op}": n for op, n in sass.items()}


print(json.dumps(counts(_segment_sums_kernel, SIG)
                 | {"address": counts(_address_sums_kernel, ADDRESS_SIG)}))
