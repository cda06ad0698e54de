#!/usr/bin/env python3
"""Check the staged FA3 kernel on the H200 machine (bench/h200.sh ``fa3-install`` runs this).

Imports what SGLang 0.5.17's ``attention_backend="fa3"`` imports
(``sglang/srt/layers/attention/flashattention_backend.py``: ``sgl_kernel.flash_attn``'s
``flash_attn_varlen_func``, ``flash_attn_with_kvcache``, ``get_scheduler_metadata``; the
backend class itself), then runs the two calls the backend makes on Qwen3-30B-A3B's head
shape (32 query heads, 4 KV heads, head dim 128, bf16) against ``torch.nn.functional.
scaled_dot_product_attention``: causal varlen prefill of two sequences, and one-token decode
from a paged KV cache (page size 1, shuffled pages). Prints ``FA3 OK`` and the errors.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

H, HKV, D = 32, 4, 128
TOL = 2e-2
"""Max abs error allowed vs SDPA in bf16 (outputs are O(1); bf16 rounding is ~4e-3)."""


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, HKV, D] -> [Lq, H, D]; causal aligned bottom-right (as FA3)."""
    rep = H // HKV
    qt, kt, vt = (x.transpose(0, 1).float() for x in (q, k.repeat_interleave(rep, 1),
                                                       v.repeat_interleave(rep, 1)))
    mask = None
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(0, 1)


def check_varlen(fa) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [37, 100]
    tot = sum(lens)
    q, k, v = (torch.randn(tot, n, D, device="cuda", generator=g, dtype=torch.bfloat16)
               for n in (H, HKV, HKV))
    cu = torch.tensor([0, lens[0], tot], dtype=torch.int32, device="cuda")
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen_q=max(lens),
                                    max_seqlen_k=max(lens), causal=True)
    ref = torch.cat([_sdpa(q[a:b], k[a:b], v[a:b], True) for a, b in ((0, lens[0]), (lens[0], tot))])
    return (out.float() - ref).abs().max().item()


def check_paged_decode(fa) -> float:
    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [5, 64, 129]
    pages = sum(lens) + 7
    kc, vc = (torch.randn(pages, 1, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
              for _ in range(2))
    perm = torch.randperm(pages, device="cuda", generator=g).to(torch.int32)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(lens):
        table[i, :n] = perm[start:start + n]
        start += n
    q = torch.randn(len(lens), 1, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table,
                                     causal=True)
    err = 0.0
    for i, n in enumerate(lens):
        idx = table[i, :n].long()
        ref = _sdpa(q[i], kc[idx, 0], vc[idx, 0], True)
        err = max(err, (out[i].float() - ref).abs().max().item())
    return err


def main() -> int:
    import sgl_kernel.flash_attn as fa
    from sgl_kernel.flash_attn import get_scheduler_metadata  # noqa: F401  (the backend's import)
    from sglang.srt.layers.attention.flashattention_backend import (  # noqa: F401
        FlashAttentionBackend,
    )

    print("torch", torch.__version__, "device", torch.cuda.get_device_name(),
          "is_fa3_supported", fa.is_fa3_supported())
    errs = {"varlen_prefill": check_varlen(fa), "paged_decode": check_paged_decode(fa)}
    ok = all(e < TOL for e in errs.values())
    print("FA3 OK" if ok else "FA3 MISMATCH", {k: round(e, 5) for k, e in errs.items()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
