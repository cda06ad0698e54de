"""Scoring is bounded by construction: a lexical budget on numeric literals before sympy
parses anything, and a hard per-answer time limit that library code cannot swallow."""

from __future__ import annotations

import threading
import warnings

import pytest

import megatron_qrl.rewards.math as rm
from megatron_qrl.rewards import answers_equal, score_math
from megatron_qrl.rewards.deadline import TimeLimitExceeded, time_limit


def _in_thread(fn, timeout: float = 30.0):
    """``fn()`` in a daemon thread (also a non-main thread, as in a Ray actor); fails the test
    instead of hanging it when ``fn`` does not return within ``timeout``."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"scoring did not return within {timeout} s"
    return out[0]


@pytest.mark.parametrize("literal", ["1e999999", "1E999999", "2.5e-99999", "1e309", "x+1e400"])
def test_huge_decimal_exponents_are_over_budget_before_any_parse(literal, monkeypatch):
    def never(s, evaluate):
        raise AssertionError(f"sympy parsed {s!r}")

    monkeypatch.setattr(rm, "_parse", never)
    res = _in_thread(lambda: score_math(rf"\boxed{{{literal}}}", "5"))
    assert (res.reward, res.correct, res.formatted, res.over_budget) == (0.0, False, False, True)
    assert answers_equal(literal, "5") is False
    with pytest.raises(rm.OverBudget, match="exponent"):
        rm.lexical_budget(literal.lower())


def test_literals_within_budget_still_parse():
    rm.lexical_budget("1e308+2.5e-3x+x2e999")  # "x2e999" is a name, not a literal
    assert answers_equal("1e3", "1000") and answers_equal("2.5e-1", "1/4")
    assert score_math(r"\boxed{1e2}", "100").correct
    with pytest.raises(rm.OverBudget, match="digits"):
        rm.lexical_budget("1" * (rm.MAX_LITERAL_DIGITS + 1))


def test_the_time_limit_interrupts_code_that_swallows_exceptions_in_any_thread(monkeypatch):
    """A sympy step that loops forever and catches ``Exception`` is still stopped: the
    answer is scored wrong, counted as over budget and a warning names the time limit."""
    def stubborn(s, evaluate):
        while True:
            try:
                sum(range(10))
                abs(-1)
                (lambda: None)()
            except Exception:  # noqa: BLE001, S110 - what sympy does in many places
                pass

    monkeypatch.setattr(rm, "_parse", stubborn)
    monkeypatch.setattr(rm, "MAX_SECONDS", 0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = _in_thread(lambda: score_math(r"\boxed{x+1}", "x+1"))
    assert (res.reward, res.over_budget) == (0.0, True)
    assert any("took longer than 0.2 s" in str(w.message) for w in caught)
    assert _in_thread(lambda: answers_equal("x+1", "1+x")) is False


def test_time_limit_restores_the_previous_tracer_and_passes_quick_work():
    import sys

    before = sys.gettrace()
    with time_limit(5.0):
        assert sum(range(100)) == 4950
    assert sys.gettrace() is before
    with pytest.raises(TimeLimitExceeded):
        with time_limit(0.0):
            (lambda: None)()
    assert sys.gettrace() is before
