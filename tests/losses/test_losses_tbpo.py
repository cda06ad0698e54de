"""TBPO (QaRL, docs/ALGORITHMS.md section 5): closed form, band masks, dual clip."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_qrl.losses import PolicyLossConfig, compute_policy_loss


def _two_sequences():
    """Seq 0: A=+1, mean(lp-lprox)=1e-3, mean(lprox-lbehav)=0.2 (inside the band).
    Seq 1: A=-1, mean(lp-lprox)=-2e-4, mean(lprox-lbehav)=1.0 (w~ = e > C_w = 2: out of band)."""
    lprox = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    lp = (lprox + torch.tensor([[1e-3, 1e-3], [-2e-4, -2e-4]])).requires_grad_()
    lbehav = lprox - torch.tensor([[0.1, 0.3], [1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    return lp, lprox, lbehav, adv, torch.ones(2, 2, dtype=torch.bool)


def test_tbpo_closed_form_each_mask_rule():
    lp, lprox, lbehav, adv, mask = _two_sequences()
    # seq 0: r = e^1e-3 > 1 + 4e-4 -> clipped to 1.0004; w = e^0.2
    l0 = min(math.exp(1e-3), 1.0004) * math.exp(0.2)
    # seq 1: r = e^-2e-4 in [1-3e-4, 1+7e-4]; L = max(min(-r, -r), -(1.0007)) = -r; w = min(e, 2)
    l1 = -math.exp(-2e-4) * 2.0
    expected = {"none": -(l0 + l1) / 2, "band_w": -l0 / 2, "band_r": -(l0 + l1) / 2}
    for rule, value in expected.items():
        cfg = PolicyLossConfig(kind="tbpo", tbpo_mask=rule)
        loss, m = compute_policy_loss(lp, lprox, lbehav, adv, mask, cfg)
        assert loss.item() == pytest.approx(value, rel=1e-6), rule
        assert m["tbpo_out_band_w_frac"].item() == 0.5
        assert m["tbpo_out_band_r_frac"].item() == 0.0
        assert m["tbpo_seq_mask_frac"].item() == {"none": 0, "band_w": 0.5, "band_r": 0}[rule]
        assert m["clip_frac_high"].item() == 0.5  # seq 0


def test_tbpo_negative_dual_clip():
    lprox = torch.zeros(1, 3)
    lp = torch.full((1, 3), 0.01, requires_grad=True)  # r = e^0.01 > 1 + 7e-4
    cfg = PolicyLossConfig(kind="tbpo", tbpo_mask="none")
    loss, m = compute_policy_loss(lp, lprox, lprox, torch.tensor([-2.0]), torch.ones(1, 3), cfg)
    assert loss.item() == pytest.approx(2.0 * 1.0007, rel=1e-7)  # -(1 + eps_h_neg) * A
    assert m["dual_clip_frac"].item() == 1.0
    loss.backward()
    assert (lp.grad == 0).all()


def test_tbpo_gradient_in_band_is_sequence_mean():
    # In the clip band: L = r A, dL/dlp_t = r A / n; loss = -mean_i(w_i L_i).
    lprox = torch.zeros(1, 4)
    lp = torch.full((1, 4), 1e-4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    cfg = PolicyLossConfig(kind="tbpo", tbpo_mask="none")
    loss, _ = compute_policy_loss(lp, lprox, lprox, torch.tensor([0.5]), mask, cfg)
    loss.backward()
    r = math.exp(1e-4)
    expected = torch.tensor([[-r * 0.5 / 3] * 3 + [0.0]])
    torch.testing.assert_close(lp.grad, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rule", ["band_w", "band_r"])
def test_tbpo_masks_exactly_the_sequences_outside_the_band(rule):
    g = torch.Generator().manual_seed(0)
    b, s, cap = 8, 6, 2.0
    lprox = -torch.rand(b, s, generator=g) * 2
    # Per-sequence mean offsets straddling +-log 2 = +-0.693.
    offsets = torch.tensor([0.0, 0.5, -0.5, 0.8, -0.8, 0.69, -0.7, 1.5])
    if rule == "band_w":
        lbehav, lp = lprox - offsets[:, None], lprox + 1e-4
    else:
        lbehav, lp = lprox - 0.01, lprox + offsets[:, None]
    mask = torch.ones(b, s, dtype=torch.bool)
    adv = torch.ones(b)
    outside = offsets.abs() > math.log(cap)
    lp = lp.clone().requires_grad_()
    cfg = PolicyLossConfig(
        kind="tbpo", tbpo_mask=rule, tis_cap=cap, tbpo_eps_low=0.9, tbpo_eps_high=9.0
    )  # wide clip: every kept seq has grad
    loss, m = compute_policy_loss(lp, lprox, lbehav, adv, mask, cfg)
    loss.backward()
    has_grad = lp.grad.abs().sum(-1) > 0
    assert has_grad.tolist() == (~outside).tolist()
    assert m["tbpo_seq_mask_frac"].item() == pytest.approx(outside.float().mean().item())
    # The loss equals the sum of the kept sequences' own losses over all sequences.
    per_row = []
    for i in range(b):
        li, _ = compute_policy_loss(lp[i:i + 1].detach(), lprox[i:i + 1], lbehav[i:i + 1],
                                    adv[i:i + 1], mask[i:i + 1], cfg)  # fmt: skip
        per_row.append(0.0 if outside[i] else li.item())
    assert loss.item() == pytest.approx(sum(per_row) / b, rel=1e-6)


def test_tbpo_token_advantages_are_reduced_to_the_sequence_mean():
    lp, lprox, lbehav, adv, mask = _two_sequences()
    tok_adv = torch.tensor([[0.5, 1.5], [-1.0, -1.0]])
    cfg = PolicyLossConfig(kind="tbpo")
    a, _ = compute_policy_loss(lp, lprox, lbehav, adv, mask, cfg)
    b, _ = compute_policy_loss(lp, lprox, lbehav, tok_adv, mask, cfg)
    assert a.item() == pytest.approx(b.item())
