"""KV-cache formats (megatron_qrl/quant/kv_cache.py) against closed-form FP8 grids
(tests/helpers/kv_grid.py enumerates every code from the format definition)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_qrl.quant.kv_cache import (
    KVCacheFormat,
    cast_overflow_behaviour,
    fake_quant_kv,
    get_kv_format,
    list_kv_formats,
    overflow_report,
    register_kv_format,
)
from tests.helpers.kv_grid import positive_grid, round_half_even

FP8 = ("fp8_e4m3", "fp8_e5m2")


def test_registry_names_and_sglang_values():
    assert list_kv_formats()[:3] == ["bf16", "fp8_e4m3", "fp8_e5m2"]
    # the values SGLang 0.5.17's configure_kv_cache_dtype accepts for these
    assert [get_kv_format(n).sglang_kv_cache_dtype for n in list_kv_formats()] == [
        "bf16", "fp8_e4m3", "fp8_e5m2"]
    assert not get_kv_format("bf16").quantizes and get_kv_format("fp8_e4m3").quantizes
    with pytest.raises(ValueError, match="--qrl-rollout-kv-cache 'int4'.*fp8_e4m3"):
        get_kv_format("int4")
    with pytest.raises(ValueError, match="already registered"):
        register_kv_format(KVCacheFormat("fp8_e4m3", "fp8_e4m3", torch.float8_e4m3fn))


@pytest.mark.parametrize("name", FP8)
def test_every_code_is_a_fixed_point_and_max(name):
    grid = positive_grid(name)
    fmt = get_kv_format(name)
    assert fmt.max_finite == grid[-1]
    x = torch.tensor(grid + [-g for g in grid], dtype=torch.float32)
    assert torch.equal(fake_quant_kv(x, name), x)


@pytest.mark.parametrize("name", FP8)
def test_random_values_round_to_nearest_even(name):
    grid = positive_grid(name)
    g = torch.Generator().manual_seed(0)
    mag = torch.exp(torch.empty(4000).uniform_(math.log(grid[1] / 4), math.log(grid[-1]), generator=g))
    x = mag * torch.where(torch.rand(4000, generator=g) < 0.5, -1.0, 1.0)
    want = torch.tensor([round_half_even(float(v), grid) for v in x])
    assert torch.equal(fake_quant_kv(x, name), want)


@pytest.mark.parametrize("name", FP8)
def test_exact_midpoints_tie_to_even(name):
    grid = positive_grid(name)
    mids = [(a + b) / 2 for a, b in zip(grid[:-1], grid[1:])]
    x = torch.tensor(mids, dtype=torch.float32)
    want = torch.tensor([grid[i] if i % 2 == 0 else grid[i + 1] for i in range(len(mids))])
    assert torch.equal(fake_quant_kv(x, name), want)
    # midpoints are where a mutation to round-half-up / -down would show
    assert not torch.equal(want, torch.tensor(grid[1:])) and not torch.equal(want, torch.tensor(grid[:-1]))


def test_e4m3_closed_form_points():
    x = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 450.0, 464.0, -0.3])
    want = torch.tensor([1.0, 1.25, 0.0, 2.0**-8, 448.0, 448.0, -0.3125])
    assert torch.equal(fake_quant_kv(x, "fp8_e4m3"), want)


def test_scale_divides_then_multiplies():
    x = torch.tensor([900.0, -3.0, 0.1])
    # 900/2 = 450 -> 448 -> 896; -3/2 = -1.5 exact; 0.1/2 = 0.05 -> 0.05078125 (13 * 2^-8)
    want = torch.tensor([896.0, -3.0, 2 * 13 * 2.0**-8])
    assert torch.equal(fake_quant_kv(x, "fp8_e4m3", scale=2.0), want)


def test_scale_division_rounds_to_the_activation_dtype_first():
    """SGLang divides in place in bf16 (``cache_k.div_(k_scale)``), then casts: x / s =
    1.06274.. rounds to bf16 1.0625, an exact e4m3 midpoint that ties to 1.0 — a direct fp32
    cast would give 1.125."""
    s = 1 / 1.06274
    x = torch.tensor([1.0], dtype=torch.bfloat16)
    got = fake_quant_kv(x, "fp8_e4m3", scale=s)
    assert got.dtype == torch.bfloat16
    assert got.item() == torch.tensor(1.0 * s).to(torch.bfloat16).item()
    assert got.item() != torch.tensor(1.125 * s).to(torch.bfloat16).item()


def test_bf16_format_is_identity():
    x = torch.randn(5, 3, dtype=torch.bfloat16)
    assert fake_quant_kv(x, "bf16") is x


def test_straight_through_gradient():
    x = (torch.randn(64, generator=torch.Generator().manual_seed(1)) * 50).requires_grad_()
    w = torch.arange(64.0)
    (fake_quant_kv(x, "fp8_e4m3", scale=0.5) * w).sum().backward()
    assert torch.equal(x.grad, w)


def test_bad_scale_is_refused():
    with pytest.raises(ValueError, match="scale must be > 0"):
        fake_quant_kv(torch.ones(2), "fp8_e4m3", scale=0.0)


@pytest.mark.parametrize("name", FP8)
def test_overflow_report_counts_what_cannot_round_back(name):
    grid = positive_grid(name)
    step = grid[-1] - grid[-2]
    mid = grid[-1] + step / 2
    tie_overflows = (len(grid) - 1) % 2 == 1  # e5m2's max has an odd last mantissa bit
    x = torch.tensor([grid[-1], mid, mid + step / 4, -4 * mid, float("nan"), 1.0])
    rep = overflow_report(x, name)
    assert rep.threshold == mid and rep.amax == 4 * mid
    assert rep.count == 2 + int(tie_overflows)
    assert overflow_report(x, name, scale=8.0).count == 0


@pytest.mark.parametrize("name", FP8)
def test_overflow_behaviour_is_what_the_cast_does(name):
    """The probe reports this torch build's behaviour; the fake quantizer reproduces it (it
    is the engine's own cast on the same device)."""
    big = 4 * positive_grid(name)[-1]
    got = fake_quant_kv(torch.tensor([big]), name).item()
    beh = cast_overflow_behaviour(name)
    assert beh in ("nan", "inf", "saturate")
    assert {"nan": math.isnan(got), "inf": got == math.inf,
            "saturate": got == positive_grid(name)[-1]}[beh]
    assert cast_overflow_behaviour("bf16") == "none"
