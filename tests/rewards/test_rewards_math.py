"""Math reward: answer extraction, numeric/symbolic comparison, {0, 0.1, 1.1} values."""

from __future__ import annotations

from fractions import Fraction

import pytest

from megatron_qrl.rewards import (
    answers_equal,
    extract_answer,
    extract_boxed,
    extract_last_number,
    math_reward,
    parse_number,
    score_math,
)


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}} then \boxed{7}", "7"),
    (r"\boxed{\frac{a^{2}}{b}}", r"\frac{a^{2}}{b}"),
    (r"\boxed {x+1}", "x+1"),
    (r"\boxed{1", None),
    ("no box", None),
    (r"\boxed{}", ""),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("12+345=357", "357"),
    ("the answer is -5", "-5"),
    ("3-5", "5"),
    ("total 1,234 apples", "1,234"),
    ("pay 3.75 dollars", "3.75"),
    ("half is 1/2", "1/2"),
    ("list 1,2,3", "3"),
    ("x.5 and .25", ".25"),
    ("none here", None),
])
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


def test_extract_answer_prefers_boxed_and_require_boxed():
    assert extract_answer(r"7 then \boxed{8} then 9") == "8"
    assert extract_answer("7 then 9") == "9"
    assert extract_answer("7 then 9", require_boxed=True) is None
    assert extract_answer(r"\boxed{}", require_boxed=True) is None


@pytest.mark.parametrize("text, expected", [
    ("12", Fraction(12)), ("-3.5", Fraction(-7, 2)), ("1,234", Fraction(1234)),
    ("3/4", Fraction(3, 4)), (r"\frac{3}{4}", Fraction(3, 4)), (r"-\frac{1}{2}", Fraction(-1, 2)),
    (r"\dfrac{6}{4}", Fraction(3, 2)), ("$5$", Fraction(5)), ("x = 5", Fraction(5)),
    ("+.5", Fraction(1, 2)), ("2.", Fraction(2)), ("1/0", None), ("1,23", None), ("x+1", None),
])
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("a, b, equal", [
    ("0.5", "1/2", True), ("1,000", "1000", True), ("-2", "-2.0", True), ("0.33", "1/3", False),
    ("x^2+2x+1", "(x+1)^2", True), (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}", True),
    (r"2\pi", "2pi", True), ("x+1", "x+2", False), ("2^(10)", "1024", True),
])
def test_answers_equal(a, b, equal):
    assert answers_equal(a, b) is equal


@pytest.mark.parametrize("unsafe", ["9^9^9", "9^999", "x^(x^x)", "__import__(1)", "a.b",
                                    "exp(1)", "x" * 80])
def test_unsafe_or_long_strings_never_reach_sympy(unsafe, monkeypatch):
    import sympy.parsing.sympy_parser as sp

    def boom(*a, **k):
        raise AssertionError("sympy parse_expr must not be called")

    monkeypatch.setattr(sp, "parse_expr", boom)
    assert answers_equal(unsafe, "1") is False


@pytest.mark.parametrize("response, answer, reward", [
    ("357", "357", 1.1),                      # correct, formatted
    (r"I think \boxed{357}", "357", 1.1),
    ("356", "357", 0.1),                      # readable but wrong
    ("abc", "357", 0.0),                      # nothing readable
    (r"\boxed{357", "357", 1.1),              # unbalanced box: falls back to the last number
    (r"\boxed{35 7", "357", 0.1),             # ... which is 7 here
    (r"\boxed{1/2}", r"\boxed{0.5}", 1.1),    # boxed reference
    (r"\boxed{9^999}", "1", 0.0),             # unreadable (unsafe) answer
])
def test_reward_values(response, answer, reward):
    assert math_reward(response, answer) == pytest.approx(reward)


def test_reward_values_are_only_0_01_11_and_bonus_is_optional():
    cases = [("1", "1"), ("2", "1"), ("x", "1"), (r"\boxed{1}", "1"), ("a 1 b 2", "2")]
    assert {math_reward(r, a) for r, a in cases} <= {0.0, 0.1, 1.1}
    assert math_reward("1", "1", format_bonus=0.0) == 1.0
    assert math_reward("2", "1", format_bonus=0.0) == 0.0
    res = score_math("7", "7", require_boxed=True)
    assert (res.reward, res.correct, res.formatted, res.extracted) == (0.0, False, False, None)
    with pytest.raises(ValueError, match="--qrl-task-format-bonus"):
        math_reward("1", "1", format_bonus=2.0)
    with pytest.raises(ValueError, match="reference answer"):
        math_reward("1", r"\boxed{1")
