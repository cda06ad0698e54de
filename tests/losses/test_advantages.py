"""GRPO / Dr.GRPO group advantages (docs/ALGORITHMS.md section 1)."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.losses import (
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    tokens_from_sequence,
)


def test_grpo_closed_form_with_non_contiguous_groups():
    # group 7: rewards {1, 0, 1, 1}: mean 0.75, unbiased std 0.5
    # group 3: {0.5, 0.5} zero variance -> 0;  group 11: a single response -> 0
    rewards = torch.tensor([1.0, 0.5, 0.0, 1.0, 0.5, 1.0, 2.0])
    groups = torch.tensor([7, 3, 7, 7, 3, 7, 11])
    adv = grpo_advantages(rewards, groups)
    d = 0.5 + 1e-6
    expected = torch.tensor([0.25 / d, 0.0, -0.75 / d, 0.25 / d, 0.0, 0.25 / d, 0.0])
    torch.testing.assert_close(adv, expected)
    dr = dr_grpo_advantages(rewards, groups)
    torch.testing.assert_close(dr, torch.tensor([0.25, 0.0, -0.75, 0.25, 0.0, 0.25, 0.0]))


def test_zero_variance_groups_are_exactly_zero_never_nan():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.1, 1.1, 1.1, 0.3])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    for mode in ("grpo", "dr_grpo"):
        adv = group_advantages(rewards, groups, mode)
        assert torch.equal(adv, torch.zeros(7)), mode


def test_grpo_matches_reference_loop_on_random_groups():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (40,), generator=g).float() * 0.55
    groups = torch.randint(0, 6, (40,), generator=g)
    adv = grpo_advantages(rewards, groups)
    for gid in groups.unique():
        sel = groups == gid
        r = rewards[sel]
        if r.numel() < 2 or (r == r[0]).all():
            assert (adv[sel] == 0).all()
        else:
            torch.testing.assert_close(adv[sel], (r - r.mean()) / (r.std() + 1e-6))


def test_integer_rewards_and_bad_inputs():
    adv = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert adv.dtype == torch.float32 and adv[0] > 0 > adv[1]
    with pytest.raises(ValueError, match="group_index"):
        grpo_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="mode"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), "ppo")


def test_tokens_from_sequence():
    out = tokens_from_sequence(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [0, 1, 1]]))
    assert out.tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]
