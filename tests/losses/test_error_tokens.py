"""QaRL error tokens: repetition, improbable tokens, mask / drop-sequence, rates."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.losses import (
    ErrorTokenConfig,
    detect_error_tokens,
    filter_error_tokens,
    repetition_mask,
)


def test_repetition_flags_exactly_the_repeated_span():
    # 3 prefix tokens, the bigram (5, 6) six times back to back (12 tokens), one suffix token
    ids = torch.tensor([[1, 2, 3] + [5, 6] * 6 + [9]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    got = repetition_mask(ids, valid, max_ngram=4, min_repeats=3, min_span_tokens=12)
    assert got[0].nonzero().flatten().tolist() == list(range(3, 15))
    # span floor: 12 tokens is not enough for a floor of 13
    assert not repetition_mask(ids, valid, 4, 3, 13).any()
    # repeat count: 6 repeats < 7
    assert not repetition_mask(ids, valid, 4, 7, 1).any()


def test_short_legit_repeats_are_not_flagged_by_default():
    ids = torch.tensor([[4, 0, 0, 0, 7, 8, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]])
    z = torch.zeros(1, 16)
    assert not detect_error_tokens(ids, z, z).any()


def test_single_token_loop_and_masked_tokens():
    ids = torch.tensor([[1] * 20])
    valid = torch.ones(1, 20, dtype=torch.bool)
    valid[0, 10] = False  # an invalid token breaks the run: two runs of 10 < 12
    assert repetition_mask(ids, torch.ones_like(valid), 16, 3, 12).all()
    assert not repetition_mask(ids, valid, 16, 3, 12).any()


def test_improbable_tokens():
    ids = torch.arange(5).unsqueeze(0)
    lprox = torch.tensor([[-12.0, -12.0, -5.0, -12.0, -20.0]])
    lbehav = torch.tensor([[-1.0, -11.0, 0.0, -6.0, -0.1]])
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    got = detect_error_tokens(ids, lprox, lbehav, mask, ErrorTokenConfig(tau=-10.0, behav_gap=5.0))
    # token0: gap 11 -> flagged; token1: gap 1; token2: above tau; token3: gap 6 -> flagged;
    # token4: masked
    assert got.tolist() == [[True, False, False, True, False]]


@pytest.mark.parametrize("action", ["none", "mask", "drop_sequence"])
def test_filter_actions_and_rates(action):
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
    lprox = torch.full((2, 6), -1.0)
    lprox[0, 2] = -15.0  # one improbable token in row 0
    lbehav = torch.full((2, 6), -1.0)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    new_mask, m = filter_error_tokens(ids, lprox, lbehav, mask, ErrorTokenConfig(action=action))
    assert m["error_token_rate"].item() == pytest.approx(1 / 9)
    assert m["error_improbable_rate"].item() == pytest.approx(1 / 9)
    assert m["error_repetition_rate"].item() == 0.0
    assert m["error_seq_rate"].item() == pytest.approx(0.5)
    expected = mask.clone()
    if action == "mask":
        expected[0, 2] = False
    elif action == "drop_sequence":
        expected[0] = False
    assert torch.equal(new_mask, expected)
    dropped = (mask.sum() - expected.sum()).item() / 9
    assert m["error_dropped_token_frac"].item() == pytest.approx(dropped)


def test_config_errors():
    with pytest.raises(ValueError, match="action"):
        ErrorTokenConfig(action="skip")
    with pytest.raises(ValueError, match="min_repeats"):
        ErrorTokenConfig(min_repeats=1)


def _loop_repetition_mask(token_ids, valid, max_ngram, min_repeats, min_span_tokens):
    """The per-period loop (the earlier implementation) as the reference."""
    from megatron_qrl.losses.error_tokens import _run_lengths

    flagged = torch.zeros_like(valid)
    seq = token_ids.shape[-1]
    for n in range(1, min(max_ngram, seq - 1) + 1):
        eq = (token_ids[:, n:] == token_ids[:, :-n]) & valid[:, n:] & valid[:, :-n]
        run = _run_lengths(eq)
        hit = (run >= (min_repeats - 1) * n) & (run + n >= min_span_tokens) & eq
        flagged[:, :-n] |= hit
        flagged[:, n:] |= hit
    return flagged & valid


def test_repetition_mask_all_periods_at_once_equals_the_loop():
    g = torch.Generator().manual_seed(0)
    flagged = 0
    for _ in range(150):
        b, s, v = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                   ((1, 4), (1, 60), (1, 4)))
        ids = torch.randint(0, v, (b, s), generator=g)
        valid = torch.rand(b, s, generator=g) < 0.9
        for args in ((16, 3, 12), (4, 3, 6), (2, 2, 1), (8, 4, 3)):
            want = _loop_repetition_mask(ids, valid, *args)
            assert torch.equal(repetition_mask(ids, valid, *args), want), (b, s, args)
            flagged += int(want.any())
    assert flagged > 100  # the cases flag something


def test_repetition_mask_ops_do_not_grow_with_the_periods():
    """A fixed number of torch ops for any ``max_ngram`` (the loop issued ~50 per period: ~800
    kernel launches per micro batch at the default 16)."""
    from megatron_qrl.utils.op_census import OpCensus

    ids = torch.randint(0, 3, (2, 64), generator=torch.Generator().manual_seed(1))
    counts = []
    for max_ngram in (2, 16):
        census = OpCensus()
        with census.phase("p"):
            repetition_mask(ids, torch.ones_like(ids, dtype=torch.bool), max_ngram, 3, 12)
        counts.append(census.total_ops("p"))
    assert counts[0] == counts[1] <= 50, counts
