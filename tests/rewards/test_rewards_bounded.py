"""Math reward scoring is bounded whatever a model answers: towers, huge
factorials, deeply nested brackets and 1 MB strings score fast as wrong answers.

No test times anything: each asserts the structural bound instead — an over-budget answer is
refused BEFORE sympy evaluates it (the evaluated parse is never reached), and the results
(reward, ``over_budget``) are what the budget says.
"""

from __future__ import annotations

import pytest

import megatron_qrl.rewards.math as rm
from megatron_qrl.rewards import answers_equal, extract_answer, score_math

MB = 1 << 20


@pytest.fixture
def no_evaluation(monkeypatch):
    """Fail if sympy is asked to EVALUATE an expression (the unevaluated parse is fine)."""
    parse = rm._parse

    def guarded(s, evaluate):
        if evaluate:
            raise AssertionError(f"sympy evaluated {s!r}")
        return parse(s, evaluate)

    monkeypatch.setattr(rm, "_parse", guarded)


@pytest.mark.parametrize("tower", [r"9^9^9", r"99^99^99", r"9^{9^{9}}", r"2^{10^6}",
                                   r"(((9^64)^64)^64)", r"x^(2^(2^5))", r"2^(n+10^10)",
                                   r"(x+1)^{1000}", r"(a+b+c+d+e)^{40}", r"3^{-99999}"])
def test_towers_and_huge_powers_are_over_budget_and_never_evaluated(tower, no_evaluation):
    res = score_math(rf"the answer is \boxed{{{tower}}}", "3")
    assert (res.reward, res.correct, res.formatted, res.over_budget) == (0.0, False, False, True)
    assert answers_equal(tower, "3") is False
    with pytest.raises(rm.OverBudget):
        rm._sympify(tower)


@pytest.mark.parametrize("answer", [r"100000!", r"1000000!", r"factorial(100000)",
                                    r"\Gamma(10^9)", r"(10^6)!"])
def test_huge_factorials_are_wrong_without_evaluation(answer, no_evaluation):
    res = score_math(rf"\boxed{{{answer}}}", "3")
    assert res.reward == 0.0 and not res.correct


@pytest.mark.parametrize("depth", [40, 5000, 400_000])
def test_deeply_nested_brackets(depth):
    for open_, close in (("{", "}"), ("(", ")"), ("[", "]")):
        res = score_math(r"\boxed{" + open_ * depth + "3" + close * depth + "}", "3")
        assert not res.correct or depth <= 40
        assert res.reward in (0.0, 0.1, 1.1)
        if depth > rm.MAX_ANSWER_CHARS:
            assert res.over_budget or res.reward == 0.0
    assert answers_equal("(" * 10 + "1/2" + ")" * 10, "0.5") is True  # shallow ones still read


@pytest.mark.parametrize("text", [
    "1" * MB,                                  # one 1 MB integer (int() refuses > 4300 digits)
    "1/" * (MB // 2) + "1",                    # a 1 MB chain of fractions
    r"\boxed{" + "1" * MB + "}",               # a 1 MB boxed answer
    r"\boxed{" * (MB // 7),                    # a 1 MB run of unclosed boxes
    r"\boxed{" + "x" * MB,                     # an unclosed box with 1 MB of content
    "1." * (MB // 2), "a-1,0" * (MB // 5), "-" * MB, "x " * (MB // 2),
])
def test_one_megabyte_answers_are_wrong_not_fatal(text, no_evaluation):
    res = score_math(text, "3")
    assert not res.correct and res.reward in (0.0, 0.1)


def test_the_final_answer_is_still_found_after_a_megabyte():
    junk = "blah " * (MB // 5)
    assert score_math(junk + r"so \boxed{3}.", "3").correct
    assert score_math(r"\boxed{3} " + junk, "3").correct  # a box far from the end
    assert extract_answer(junk + " 42") == "42"
    assert score_math("9" * (rm.MAX_ANSWER_CHARS - 10), "9" * (rm.MAX_ANSWER_CHARS - 10)).correct


@pytest.mark.parametrize("a, b, equal", [
    ("(x+y)^{10}", "(y+x)^10", True), ("2^{10}", "1024", True), (r"\sqrt{8}", r"2\sqrt{2}", True),
    ("(a+b)^8", "(b+a)^8", True), ("x^2+2x+1", "(x+1)^2", True), ("(x+1)^2", "x^2+1", False),
    (r"\frac{x^2-1}{x-1}", "x+1", True), (r"2^{64}", "18446744073709551616", True),
])
def test_answers_within_budget_still_compare(a, b, equal):
    assert answers_equal(a, b) is equal


def test_expression_cost_bounds():
    tree = rm._parse("(a+b+c)**3*(x+1)**2", evaluate=False)
    bits, degree, terms = rm.expression_cost(tree)
    assert degree == 5 and terms == 10 * 3  # C(5, 3) monomials times C(3, 2)
    with pytest.raises(rm.OverBudget, match="exponent"):
        rm.expression_cost(rm._parse("2**(3**5)", evaluate=False))
