"""Causal attention that reads K/V the way the rollout engine's KV cache serves them.

With a quantized KV cache (``--qrl-rollout-kv-cache fp8_e4m3``) SGLang 0.5.17's Triton backend
(``sglang/srt/layers/attention/triton_backend.py``) computes:

* the prefill (EXTEND) pass: K/V of the new tokens are stored in the cache first, then the
  attention of those tokens runs on the FRESH (unrounded) K/V of the new tokens and the cached
  (rounded) K/V of any prefix already in the cache;
* every decode step: the current token's K/V are stored, then its attention reads ALL K/V,
  itself included, from the rounded cache.

A rollout sample is ``prompt (P tokens) + response``. Without a cached prefix the prompt is one
prefill pass, so query positions ``0 .. P-1`` (position ``P-1`` produces response token 0) see
unrounded K/V; the decode step at position ``t >= P`` (which produces response token
``t - P + 1``) sees rounded K/V of positions ``0 .. t``. Each query row therefore attends to one
K/V set in full, and the rollout's attention is, per row ``t`` of sample ``b``,
``softmax(q_t K^T * scale) V`` (Vaswani et al. 2017, eq. 1) with ``K, V`` the bf16 ones for
``t < cache_from[b]`` and ``fake_quant_kv(K), fake_quant_kv(V)`` otherwise, ``cache_from[b] = P``.

``cache_from`` is a per-sample argument because the rule changes with the engine's mode:
``enable_deterministic_inference`` runs the unified extend kernel, which reads the new tokens
from the cache too (``cache_from = 0``); a radix-cache prefix hit or a chunked prefill makes
part of a prefill read the cache at positions the trainer cannot know, which is why the
engine options disable both when the KV cache is quantized.

The gradient of the rounding is straight-through (:func:`~megatron_qrl.quant.kv_cache.fake_quant_kv`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_qrl.quant.kv_cache import KVCacheFormat, fake_quant_kv, get_kv_format

__all__ = ["cache_from_loss_mask", "rollout_kv_attention"]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # GQA: each key/value head serves `rep` consecutive query heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale)


def rollout_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cache_from: torch.Tensor, fmt: KVCacheFormat | str,
                         softmax_scale: float, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> torch.Tensor:
    """Causal self-attention ``[b, hq, s, d]`` with rows ``t >= cache_from[b]`` reading K/V
    rounded by the KV-cache format ``fmt`` (per-tensor ``k_scale`` / ``v_scale``).

    ``q``: ``[b, hq, s, d]``; ``k``, ``v``: ``[b, hkv, s, d]`` (``hq`` a multiple of ``hkv``),
    after RoPE and q/k-norm, which is where the engine stores K. ``cache_from``: ``[b]`` integer
    positions (the prompt lengths for the engine's default mode). A format that rounds nothing
    gives plain causal attention.
    """
    fmt = get_kv_format(fmt) if isinstance(fmt, str) else fmt
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"rollout_kv_attention: q [b, hq, s, d] and k, v [b, hkv, s, d] with the "
                         f"same b and s, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"rollout_kv_attention: {q.shape[1]} query heads are not a multiple of "
                         f"{k.shape[1]} key/value heads")
    if cache_from.shape != (q.shape[0],):
        raise ValueError(f"rollout_kv_attention: cache_from must be [{q.shape[0]}] (one position "
                         f"per sample), got {tuple(cache_from.shape)}")
    fresh = _sdpa(q, k, v, softmax_scale)
    if not fmt.quantizes:
        return fresh
    cached = _sdpa(q, fake_quant_kv(k, fmt, k_scale), fake_quant_kv(v, fmt, v_scale),
                   softmax_scale)
    pos = torch.arange(q.shape[2], device=q.device)
    reads_cache = pos[None, :] >= cache_from.to(q.device)[:, None]  # [b, s]
    return torch.where(reads_cache[:, None, :, None], cached, fresh)


def cache_from_loss_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample prompt length ``P`` from a trainer batch's ``loss_mask`` ``[b, s]``
    (rl/batch.py: ``loss_mask[t]`` is on where token ``t + 1`` is a response token, so the first
    on position is ``P - 1``); a row with no response token gives ``s`` (nothing reads the cache)."""
    m = loss_mask.bool()
    first = m.to(torch.uint8).argmax(1)  # first True (argmax returns the first maximum)
    return torch.where(m.any(1), first + 1, torch.full_like(first, m.shape[1]))
