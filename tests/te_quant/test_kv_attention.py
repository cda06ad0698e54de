"""The rollout-aligned KV attention (megatron_qrl/te_quant/kv_attention.py) against a
materialised-softmax reference built row by row from the engine's rule (prefill rows read
the fresh K/V, decode rows read the rounded cache), with the rounding from tests/helpers/kv_grid.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_qrl.te_quant.kv_attention import cache_from_loss_mask, rollout_kv_attention
from tests.helpers.kv_grid import positive_grid, round_half_even

B, HQ, HKV, S, D = 3, 4, 2, 7, 8
SCALE = 1 / math.sqrt(D)


def _inputs(seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g) * 3
    v = torch.randn(B, HKV, S, D, generator=g) * 3
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _round(t, name):
    grid = positive_grid(name)
    return torch.tensor([round_half_even(float(x), grid) for x in t.detach().flatten()]).view_as(t)


def _reference(q, k, v, cache_from, name):
    """out[b, h, t] = softmax_j<=t(q_t . K_j * scale) V with K, V = rounded for t >=
    cache_from[b] (straight-through: k + (round(k) - k).detach())."""
    kq = k + (_round(k, name) - k).detach()
    vq = v + (_round(v, name) - v).detach()
    rep = HQ // HKV
    rows = []
    for b in range(B):
        heads = []
        for h in range(HQ):
            outs = []
            for t in range(S):
                kk, vv = (kq, vq) if t >= int(cache_from[b]) else (k, v)
                keys, vals = kk[b, h // rep, : t + 1], vv[b, h // rep, : t + 1]
                p = torch.softmax(keys @ q[b, h, t] * SCALE, dim=0)
                outs.append(p @ vals)
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_matches_row_by_row_reference(name):
    q, k, v = _inputs()
    cache_from = torch.tensor([3, 0, S])
    got = rollout_kv_attention(q, k, v, cache_from, name, SCALE)
    torch.testing.assert_close(got, _reference(q, k, v, cache_from, name), rtol=1e-5, atol=1e-5)


def test_prefill_rows_fresh_decode_rows_rounded():
    q, k, v = _inputs(1)
    plain = rollout_kv_attention(q, k, v, torch.tensor([3, 0, S]), "bf16", SCALE)
    got = rollout_kv_attention(q, k, v, torch.tensor([3, 0, S]), "fp8_e4m3", SCALE)
    assert torch.equal(got[0, :, :3], plain[0, :, :3])
    assert (got[0, :, 3:] - plain[0, :, 3:]).abs().amax(-1).min() > 0  # every decode row moves
    assert (got[1] - plain[1]).abs().amax(-1).min() > 0  # cache_from 0: all rows read the cache
    assert torch.equal(got[2], plain[2])  # cache_from S: a prefill-only sample
    # the bf16 format is plain causal attention (no rounding anywhere)
    rep = HQ // HKV
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True, scale=SCALE)
    torch.testing.assert_close(plain, want)


def test_gradient_matches_reference():
    cache_from = torch.tensor([2, 5, 1])
    q, k, v = _inputs(2, requires_grad=True)
    w = torch.randn(B, HQ, S, D, generator=torch.Generator().manual_seed(9))
    (rollout_kv_attention(q, k, v, cache_from, "fp8_e4m3", SCALE) * w).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    (_reference(q2, k2, v2, cache_from, "fp8_e4m3") * w).sum().backward()
    for a, b in zip(got, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bad_shapes_are_refused():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="cache_from must be"):
        rollout_kv_attention(q, k, v, torch.tensor([1, 2]), "fp8_e4m3", SCALE)
    with pytest.raises(ValueError, match="not a multiple"):
        rollout_kv_attention(q[:, :3], k, v, torch.tensor([1, 2, 3]), "fp8_e4m3", SCALE)


def test_cache_from_loss_mask():
    # rl/batch.py: loss_mask[t] on where t + 1 is a response token
    m = torch.zeros(3, 6, dtype=torch.bool)
    m[0, 2:5] = True  # prompt of 3 tokens
    m[1, 0:5] = True  # prompt of 1 token
    assert cache_from_loss_mask(m).tolist() == [3, 1, 6]
