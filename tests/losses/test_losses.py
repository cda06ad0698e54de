"""Closed-form and property tests of compute_policy_loss (docs/ALGORITHMS.md sections 1, 2, 5)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_qrl.losses import LOSS_KINDS, METRIC_NAMES, PolicyLossConfig, compute_policy_loss
from megatron_qrl.losses.token_kinds import acr_terms

# One row, four tokens. Probabilities of the sampled token under each policy:
PROX = [0.5, 0.4, 0.2, 0.1]  # pi_prox
BEHAV = [0.5, 0.25, 0.05, 0.2]  # pi_behav -> pi_prox/pi_behav = [1, 1.6, 4, 0.5]
RATIO = [1.1, 1.5, 2.0, 0.9]  # R = pi_theta / pi_prox
ADV = [1.0, 1.0, 1.0, -1.0]


def _hand_batch():
    lprox = torch.tensor([PROX]).log()
    lbehav = torch.tensor([BEHAV]).log()
    lp = (torch.tensor([RATIO]) * torch.tensor([PROX])).log().requires_grad_()
    return lp, lprox, lbehav, torch.tensor([ADV]), torch.ones(1, 4, dtype=torch.bool)


# Expected per-token surrogates (eps=0.2, C=2), derived by hand:
#   ppo_clip   : min(R A, clip(R,0.8,1.2) A)           = [1.1, 1.2, 1.2, -0.9]
#   naive_quant: ratio vs behav = [1.1, 2.4, 8, 0.45]   = [1.1, 1.2, 1.2, -0.8]
#   decoupled  : w = [1, 1.6, 4, 0.5] * ppo terms       = [1.1, 1.92, 4.8, -0.45]
#   tis        : w = [1, 1.6, 2, 0.5] * ppo terms       = [1.1, 1.92, 2.4, -0.45]
#   acr        : token 2 truncated, r = 2*0.05/0.2 = 0.5, U = 1.2/0.5 = 2.4 >= R = 2.0,
#                so its term is 2 * 2.0 = 4.0           = [1.1, 1.92, 4.0, -0.45]
EXPECTED_TERMS = {
    "ppo_clip": [1.1, 1.2, 1.2, -0.9],
    "naive_quant": [1.1, 1.2, 1.2, -0.8],
    "decoupled": [1.1, 1.92, 4.8, -0.45],
    "tis": [1.1, 1.92, 2.4, -0.45],
    "acr": [1.1, 1.92, 4.0, -0.45],
}
EXPECTED_CLIP = {  # (clip_frac_low, clip_frac_high)
    "ppo_clip": (0.0, 0.5),
    "naive_quant": (0.25, 0.5),
    "decoupled": (0.0, 0.5),
    "tis": (0.0, 0.5),
    "acr": (0.0, 0.25),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED_TERMS))
def test_token_kinds_closed_form(kind):
    lp, lprox, lbehav, adv, mask = _hand_batch()
    loss, m = compute_policy_loss(lp, lprox, lbehav, adv, mask, PolicyLossConfig(kind=kind))
    assert loss.item() == pytest.approx(-sum(EXPECTED_TERMS[kind]) / 4, abs=1e-5)
    assert m["clip_frac_low"].item() == pytest.approx(EXPECTED_CLIP[kind][0])
    assert m["clip_frac_high"].item() == pytest.approx(EXPECTED_CLIP[kind][1])
    # mismatch metrics are kind-independent
    w = [p / b for p, b in zip(PROX, BEHAV)]
    assert m["tis_trunc_frac"].item() == pytest.approx(0.25)
    assert m["prox_behav_ratio_max"].item() == pytest.approx(4.0, rel=1e-5)
    assert m["prox_behav_ratio_mean"].item() == pytest.approx(sum(w) / 4, rel=1e-5)
    k3 = sum(x - math.log(x) - 1 for x in w) / 4
    assert m["kl_behav_prox_k3"].item() == pytest.approx(k3, rel=1e-5)
    assert m["logp_abs_diff_mean"].item() == pytest.approx(sum(abs(math.log(x)) for x in w) / 4)
    assert m["num_tokens"].item() == 4


def test_every_kind_emits_every_metric():
    lp, lprox, lbehav, adv, mask = _hand_batch()
    for kind in LOSS_KINDS:
        _, m = compute_policy_loss(lp, lprox, lbehav, adv, mask, PolicyLossConfig(kind=kind))
        assert set(METRIC_NAMES) <= set(m), kind
        assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
        _, m = compute_policy_loss(
            lp, lprox, lbehav, adv, mask, PolicyLossConfig(kind=kind, kl_coef=1e-3),
            ref_log_probs=lprox, logits=torch.zeros(1, 4, 8),
        )  # fmt: skip
        assert m["entropy"].item() == pytest.approx(math.log(8), rel=1e-6)
        assert "kl_ref_k3" in m


def test_gradient_closed_form_ppo_clip():
    # d loss / d lp_t = -(1/4) * R_t * A_t where the unclipped branch is active, else 0.
    lp, lprox, lbehav, adv, mask = _hand_batch()
    loss, _ = compute_policy_loss(lp, lprox, lbehav, adv, mask, PolicyLossConfig(kind="ppo_clip"))
    loss.backward()
    expected = torch.tensor([[-1.1 / 4, 0.0, 0.0, 0.9 / 4]])
    torch.testing.assert_close(lp.grad, expected, rtol=1e-5, atol=1e-6)


def test_dual_clip_bounds_negative_advantage():
    lp = torch.tensor([[math.log(5.0)]], requires_grad=True)  # R = 5 vs prox logp 0
    zeros, adv, mask = torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1)
    plain, _ = compute_policy_loss(lp, zeros, zeros, adv, mask, PolicyLossConfig(kind="ppo_clip"))
    assert plain.item() == pytest.approx(5.0, rel=1e-5)  # -min(-5, -1.2)
    cfg = PolicyLossConfig(kind="ppo_clip", dual_clip_c=3.0)
    dual, m = compute_policy_loss(lp, zeros, zeros, adv, mask, cfg)
    assert dual.item() == pytest.approx(3.0)  # -max(-5, 3 * -1)
    assert m["dual_clip_frac"].item() == 1.0
    dual.backward()
    assert lp.grad.abs().item() == 0.0


def test_aggregation_modes_closed_form():
    # row 0: 3 valid tokens, row 1: 1 valid token; R = 1 so the per-token loss is -A.
    lp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    expected = {
        "token_mean": -(1 + 2 + 3 + 4) / 4,
        "seq_mean_token_mean": -((1 + 2 + 3) / 3 + 4 / 1) / 2,
        "seq_mean_token_sum_norm": -(1 + 2 + 3 + 4) / (2 * 4),
    }
    z = torch.zeros(2, 4)
    for agg, value in expected.items():
        cfg = PolicyLossConfig(kind="ppo_clip", aggregation=agg)
        loss, _ = compute_policy_loss(lp, z, z, adv, mask, cfg)
        assert loss.item() == pytest.approx(value), agg


def test_kl_term_k3_and_missing_ref_error():
    lp = torch.zeros(1, 2, requires_grad=True)
    z, adv, mask = torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2)
    ref = torch.tensor([[math.log(0.5), 0.0]])  # lr - lp = [-log 2, 0]
    cfg = PolicyLossConfig(kind="ppo_clip", kl_coef=0.1)
    loss, m = compute_policy_loss(lp, z, z, adv, mask, cfg, ref_log_probs=ref)
    k3 = (0.5 + math.log(2) - 1) / 2
    assert m["kl_ref_k3"].item() == pytest.approx(k3, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-6)
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_policy_loss(lp, z, z, adv, mask, cfg)


def _random_batch(seed, b=4, s=7, spread=0.3, mismatch=0.3):
    g = torch.Generator().manual_seed(seed)
    lprox = -torch.rand(b, s, generator=g) * 3 - 0.05
    lbehav = lprox + (torch.rand(b, s, generator=g) * 2 - 1) * mismatch
    lp = (lprox + (torch.rand(b, s, generator=g) * 2 - 1) * spread).requires_grad_()
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, s, generator=g) > 0.2
    return lp, lprox, lbehav, adv, mask


def _loss_and_grad(kind, lp, lprox, lbehav, adv, mask, **cfg):
    lp = lp.detach().clone().requires_grad_()
    loss, m = compute_policy_loss(lp, lprox, lbehav, adv, mask, PolicyLossConfig(kind=kind, **cfg))
    loss.backward()
    return loss.detach(), lp.grad, m


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_equals_ppo_clip_when_behav_is_prox(seed):
    lp, lprox, _, adv, mask = _random_batch(seed)
    a = _loss_and_grad("decoupled", lp, lprox, lprox, adv, mask)
    b = _loss_and_grad("ppo_clip", lp, lprox, lprox, adv, mask)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    assert a[1].abs().sum() > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tis_equals_decoupled_and_acr_equals_tis_without_truncation(seed):
    lp, lprox, lbehav, adv, mask = _random_batch(seed, mismatch=0.6)  # |d| < log 2
    dec = _loss_and_grad("decoupled", lp, lprox, lbehav, adv, mask)
    tis = _loss_and_grad("tis", lp, lprox, lbehav, adv, mask)
    acr = _loss_and_grad("acr", lp, lprox, lbehav, adv, mask)
    assert tis[2]["tis_trunc_frac"].item() == 0.0
    for x, y in ((tis, dec), (acr, tis)):
        torch.testing.assert_close(x[0], y[0])
        torch.testing.assert_close(x[1], y[1])


def test_acr_upper_bound_is_exactly_one_plus_eps_over_r_when_truncated():
    prox = torch.tensor([[0.9, 0.5, 0.3, 0.2]], dtype=torch.float64)
    behav = torch.tensor([[0.1, 0.5, 0.01, 0.15]], dtype=torch.float64)
    cap, eps = 2.5, 0.28
    cfg = PolicyLossConfig(kind="acr", tis_cap=cap, eps_high=eps)
    terms = acr_terms(torch.zeros_like(prox), prox.log(), behav.log(), cfg)
    r = behav / torch.maximum(behav, prox / cap)  # docs/ALGORITHMS.md section 2 definition
    assert (r < 1).tolist() == [[True, False, True, False]]
    torch.testing.assert_close(terms.upper, (1 + eps) / r, rtol=1e-12, atol=0)
    torch.testing.assert_close(terms.weight, torch.clamp(prox / behav, max=cap), rtol=1e-12, atol=0)
    # Behaviour: a truncated positive token keeps its gradient up to (1+eps)/r, not beyond.
    upper = ((1 + eps) / r[0, 0]).item()  # r = 2.5 * 0.1 / 0.9
    for factor, has_grad in ((0.99, True), (1.01, False)):
        lp = torch.tensor([[math.log(0.9 * upper * factor)]], requires_grad=True)
        loss, _ = compute_policy_loss(
            lp, torch.tensor([[math.log(0.9)]]), torch.tensor([[math.log(0.1)]]),
            torch.tensor([1.0]), torch.ones(1, 1), cfg,
        )  # fmt: skip
        loss.backward()
        assert (lp.grad.abs().item() > 0) == has_grad, factor


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_gradients_flow_only_through_log_probs(kind):
    lp, lprox, lbehav, adv, mask = _random_batch(3)
    others = [t.clone().requires_grad_() for t in (lprox, lbehav, adv, lprox - 0.1)]
    cfg = PolicyLossConfig(kind=kind, kl_coef=0.01)
    loss, _ = compute_policy_loss(lp, *others[:3], mask, cfg, ref_log_probs=others[3])
    loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    assert all(t.grad is None for t in others)
    assert (lp.grad[~mask] == 0).all()


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_numerically_safe_at_minus_100_and_fully_masked_rows(kind):
    lp = torch.tensor([[-100.0, 0.0, -1.0, -100.0], [0.5, 0.5, 0.5, 0.5]], requires_grad=True)
    lprox = torch.tensor([[0.0, -100.0, -100.0, -100.0], [float("nan")] * 4])
    lbehav = torch.tensor([[-100.0, 0.0, -0.5, -1.0], [float("-inf")] * 4])
    adv = torch.tensor([1.0, float("inf")])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        lp.grad = None
        cfg = PolicyLossConfig(kind=kind, aggregation=agg, dual_clip_c=3.0)
        loss, m = compute_policy_loss(lp, lprox, lbehav, adv, mask, cfg)
        loss.backward()
        assert torch.isfinite(loss), (agg, loss)
        assert torch.isfinite(lp.grad).all(), (agg, lp.grad)
        assert all(torch.isfinite(v) for v in m.values()), m
        assert (lp.grad[1] == 0).all()
    # everything masked: loss 0, grads 0
    lp.grad = None
    loss, m = compute_policy_loss(lp, lprox, lbehav, adv, torch.zeros_like(mask), cfg)
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_fully_masked_row_does_not_change_the_loss():
    lp, lprox, lbehav, adv, mask = _random_batch(5)
    mask[0] = False
    for kind in LOSS_KINDS:
        full = _loss_and_grad(kind, lp, lprox, lbehav, adv, mask, aggregation="seq_mean_token_mean")
        sub = _loss_and_grad(kind, lp[1:], lprox[1:], lbehav[1:], adv[1:], mask[1:],
                             aggregation="seq_mean_token_mean")  # fmt: skip
        torch.testing.assert_close(full[0], sub[0])


def test_config_validates_itself():
    with pytest.raises(ValueError, match="kind"):
        PolicyLossConfig(kind="grpo")
    with pytest.raises(ValueError, match="tbpo_mask"):
        PolicyLossConfig(kind="tbpo", tbpo_mask="band")
    with pytest.raises(ValueError, match="aggregation"):
        PolicyLossConfig(kind="tis", aggregation="mean")
    with pytest.raises(ValueError, match="tis_cap"):
        PolicyLossConfig(kind="tis", tis_cap=0.5)
    with pytest.raises(ValueError, match="eps_low"):
        PolicyLossConfig(kind="tis", eps_low=1.0)
    with pytest.raises(ValueError, match="dual_clip_c"):
        PolicyLossConfig(kind="tis", dual_clip_c=1.0)


def test_shape_errors_name_the_argument():
    lp, lprox, lbehav, adv, mask = _random_batch(0)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        compute_policy_loss(lp, lprox, lbehav[:, :3], adv, mask, PolicyLossConfig(kind="tis"))
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(lp, lprox, lbehav, adv[:2], mask, PolicyLossConfig(kind="tis"))
