"""utils.curves: window means, fitted slope + interval, seed mean/std and bands (closed form)."""

import math

import pytest

from megatron_qrl.utils.curves import band, fit_slope, mean_std, summary_line, t95, window_change


def test_windows_are_ten_steps_not_five():
    vals = [0.0] * 10 + [0.5] * 30 + [1.0] * 10  # 50 steps: first 10 at 0, last 10 at 1
    wc = window_change(vals)
    assert (wc.n, wc.window, wc.first, wc.last) == (50, 10, 0.0, 1.0)
    assert wc.change == 1.0
    # a 5-step window would read the same curve; a spike in steps 6-10 must count
    spiky = [0.0] * 5 + [1.0] * 5 + [0.0] * 10
    assert window_change(spiky).first == pytest.approx(0.5)


def test_short_curves_use_half_of_it():
    wc = window_change([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert (wc.window, wc.first, wc.last) == (3, 2.0, 5.0)
    assert window_change([1.0, 3.0]).slope is None
    with pytest.raises(ValueError, match="need >= 2"):
        window_change([1.0])


def test_slope_and_interval_closed_form():
    line = [2.0 + 0.25 * i for i in range(12)]
    slope, ci = fit_slope(line)
    assert slope == pytest.approx(0.25) and ci == pytest.approx(0.0, abs=1e-12)
    # residuals +-1 alternating around a flat line, n = 4: x = 0..3, y = 1, -1, 1, -1
    slope, ci = fit_slope([1.0, -1.0, 1.0, -1.0])
    sxx = 5.0  # sum (x - 1.5)^2
    assert slope == pytest.approx(-0.4)
    resid = sum((y - (0.0 - 0.4 * (x - 1.5))) ** 2 for x, y in enumerate([1, -1, 1, -1]))
    assert ci == pytest.approx(t95(2) * math.sqrt(resid / 2 / sxx))
    assert t95(2) == 4.303 and t95(11) == 2.228 and t95(100) == 1.96


def test_summary_line_names_windows_and_slope():
    line = summary_line([0.2] * 10 + [0.4] * 10)
    assert "first 10 steps 0.200" in line and "last 10 steps 0.400" in line
    assert "(+0.200, 20 steps)" in line and "fitted slope +0.0" in line and "(95%)" in line


def test_mean_std_and_band():
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)  # sample std (ddof = 1)
    assert mean_std([4.0]) == (4.0, 0.0)
    means, stds = band([[0.0, 1.0, 5.0], [2.0, 3.0]])  # truncated to the shortest
    assert means == [1.0, 2.0]
    assert stds == pytest.approx([math.sqrt(2.0), math.sqrt(2.0)])
    with pytest.raises(ValueError):
        band([])


def test_rolling_mean():
    from megatron_qrl.utils.curves import rolling_mean

    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert rolling_mean([2.0, 4.0], 10) == [2.0, 3.0]
    with pytest.raises(ValueError):
        rolling_mean([1.0], 0)
