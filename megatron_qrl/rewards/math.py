"""Verifiable math reward: extract the final answer, compare it, add a format bonus.

Reward (rlquant study, seed 003; docs/ALGORITHMS.md section 4): ``1.0`` for a correct final
answer plus ``format_bonus`` (0.1) for a well-formatted response, so the values are
``{0, 0.1, 1.1}``.

Our reading of "well formatted" (the study does not define it): the response states a
final answer we can read, i.e. :func:`extract_answer` finds one and it parses as a number
or as a safe symbolic expression. The final answer is the content of the LAST
``\\boxed{...}`` (nested braces allowed); without a ``\\boxed`` it is the last number in the
text, unless ``require_boxed`` (then a response without a ``\\boxed`` is unformatted). A
correct answer is always a readable one, hence only ``{0, 0.1, 1.1}`` occur.

Comparison: numerically and exactly (``fractions.Fraction``: integers, decimals,
``a/b`` and ``\\frac{a}{b}``, thousands commas ``1,234``, signs), else symbolically with
sympy when both sides parse as short expressions. Sympy only ever sees strings of at most
:data:`MAX_SYMBOLIC_CHARS` characters from a whitelist (digits, single-letter variables,
``+-*/^()``, ``sqrt``, ``pi``), so parsing is safe (no attribute access, no names beyond the
whitelist).

Budget (a model answer can never stall scoring): the work per answer is bounded by its
structure, and a hard time limit backs that bound up. A response is searched for ``\\boxed`` in full (a C
string search) but its braces are matched over at most :data:`MAX_ANSWER_CHARS` characters,
and the last number is looked for in the last :data:`MAX_SCAN_CHARS` characters; an answer
longer than :data:`MAX_ANSWER_CHARS` is not parsed. Before sympy sees a string, its numeric
literals are checked lexically (:func:`lexical_budget`): at most :data:`MAX_LITERAL_DIGITS`
digits and a decimal exponent (``1e308``) of at most :data:`MAX_LITERAL_EXPONENT` in magnitude
(sympy turns ``1e999999`` into an exact integer inside ONE uninterruptible C call). An
expression is then parsed
unevaluated and its cost bounded before sympy evaluates anything (:func:`expression_cost`):
exact numbers of at most :data:`MAX_BITS` bits, numeric exponents of at most
:data:`MAX_EXPONENT` (so no towers like ``9^9^9`` and no ``2^{10^6}``), polynomial degree at
most :data:`MAX_DEGREE` and at most :data:`MAX_TERMS` terms once expanded. An answer over
budget is a wrong, unformatted answer (``MathRewardResult.over_budget``, counted by the
driver as the metric ``reward_over_budget``).

Deadline: the sympy work of one answer (parse, evaluate, compare) runs under
:func:`~megatron_qrl.rewards.deadline.time_limit` of :data:`MAX_SECONDS`, which interrupts
Python code in any thread (Ray actors included) and cannot be swallowed by sympy's own
``except Exception``. An answer that runs out of time is scored like one over budget (wrong,
unformatted, ``over_budget`` set, so counted in ``reward_over_budget``) and a
``RuntimeWarning`` names it.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from fractions import Fraction

from .deadline import TimeLimitExceeded, time_limit

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_SCAN_CHARS",
    "MAX_SYMBOLIC_CHARS",
    "OverBudget",
    "MathRewardResult",
    "answers_equal",
    "expression_cost",
    "extract_answer",
    "extract_boxed",
    "extract_last_number",
    "lexical_budget",
    "math_reward",
    "parse_number",
    "reference_answer",
    "score_math",
]

MAX_SYMBOLIC_CHARS = 64
"""Longest normalised answer handed to sympy."""
MAX_ANSWER_CHARS = 1000
"""Longest final answer parsed (longer: over budget)."""
MAX_SCAN_CHARS = 65536
"""Without a ``\\boxed``, the last number is looked for in this many final characters."""
MAX_BITS = 2048
"""Largest exact number (bits of numerator + denominator) sympy may build."""
MAX_EXPONENT = 64
"""Largest magnitude (and denominator) of a numeric exponent."""
MAX_DEGREE = 16
"""Largest degree of an expression (numerators and denominators alike)."""
MAX_TERMS = 160
"""Most terms of an expression once expanded (numerators and denominators alike)."""
MAX_LITERAL_DIGITS = 600
"""Most digits of one numeric literal handed to sympy (~ :data:`MAX_BITS` bits)."""
MAX_LITERAL_EXPONENT = 308
"""Largest magnitude of a literal's decimal exponent (``1e308``; the double range)."""
MAX_SECONDS = 5.0
"""Hard time limit of the sympy work on one answer (module docstring: Deadline)."""


class OverBudget(ValueError):
    """An answer whose parsing or evaluation would exceed the budget (module docstring)."""

_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?![\d])"
    r"|(?:(?<![\w)\]}])-)?\.\d+"
)
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_SYMBOLIC_CHARS = re.compile(r"^[0-9a-z+\-*/^(). ]+$")
_WORDS = re.compile(r"[a-z]+")
_BOXED = "\\boxed"
_BRACE = re.compile(r"[{}]")
_LITERAL = re.compile(r"(?<![a-z_\d.])(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?")


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``; None if none or unbalanced; raises
    :class:`OverBudget` when its content is longer than :data:`MAX_ANSWER_CHARS`."""
    start = text.rfind(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for m in _BRACE.finditer(text, i, i + MAX_ANSWER_CHARS + 2):
                depth += 1 if m.group() == "{" else -1
                if depth == 0:
                    return text[i + 1 : m.start()].strip()
            if len(text) - i > MAX_ANSWER_CHARS + 2:
                raise OverBudget(f"\\boxed content longer than {MAX_ANSWER_CHARS} characters")
            return None  # unbalanced: the last \boxed is unreadable
        start = text.rfind(_BOXED, 0, start)
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces kept); None if there
    is none, its braces never close or it is longer than :data:`MAX_ANSWER_CHARS`."""
    try:
        return _boxed(text)
    except OverBudget:
        return None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (sign, thousands commas, decimals, ``a/b``), or None.
    Only the last :data:`MAX_SCAN_CHARS` characters are searched."""
    tail = text[-MAX_SCAN_CHARS:]
    matches = list(_NUMBER.finditer(tail))
    found = matches[-1] if matches else None
    if found is None or (found.start() == 0 and len(text) > len(tail)):
        return None  # none, or one cut by the scan window
    return found.group()


def extract_answer(text: str, require_boxed: bool = False) -> str | None:
    """The final answer: last ``\\boxed{}`` content, else (unless ``require_boxed``) the
    last number; None when there is none (or it is over budget)."""
    try:
        return _extract(text, require_boxed)
    except OverBudget:
        return None


def _extract(text: str, require_boxed: bool) -> str | None:
    boxed = _boxed(text)
    if boxed is not None or require_boxed:
        return boxed or None
    return extract_last_number(text)


def _normalise(text: str) -> str:
    s = text.strip().strip("$").strip()
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                     ("\\cdot", "*"), ("\\times", "*"), ("\\pi", "pi"), ("{,}", ",")):
        s = s.replace(old, new)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    return s.rstrip(".").strip()


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact rational (``12``, ``-3.5``, ``1,234``, ``3/4``, ``\\frac{3}{4}``,
    ``-\\frac{1}{2}``), or None if it is not a plain number."""
    if len(text) > MAX_ANSWER_CHARS:
        return None
    s = _normalise(text).replace(" ", "")
    frac = _FRAC.match(s)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if frac.group(1) == "-" else num / den
    if "/" in s:
        num_s, _, den_s = s.partition("/")
        if "/" in den_s:
            return None  # a/b/c: ambiguous
        num, den = parse_number(num_s), parse_number(den_s)
        return None if num is None or den is None or den == 0 else num / den
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    return Fraction(s.replace(",", "").rstrip("."))


def _symbolic_text(text: str) -> str | None:
    """A whitelisted python-syntax form of ``text`` for sympy, or None if it is not safe."""
    if len(text) > 4 * MAX_SYMBOLIC_CHARS:
        return None
    s = _normalise(text)
    for pattern, repl in ((r"\\sqrt\{([^{}]+)\}", r"sqrt(\1)"),
                          (r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"((\1)/(\2))")):
        for _ in range(4):  # innermost first; nesting deeper than 4 is left unparsed
            s = re.sub(pattern, repl, s)
    s = s.replace("{", "(").replace("}", ")")
    s = s.lower()
    if not s or len(s) > MAX_SYMBOLIC_CHARS or not _SYMBOLIC_CHARS.match(s) or "**" in s:
        return None
    if any(len(w) > 1 and w not in ("sqrt", "pi") for w in _WORDS.findall(s)):
        return None
    return s.replace("^", "**")


def lexical_budget(s: str) -> None:
    """Raise :class:`OverBudget` when a numeric literal of ``s`` (the whitelisted, lower-case
    form handed to sympy) has more than :data:`MAX_LITERAL_DIGITS` digits or a decimal
    exponent beyond :data:`MAX_LITERAL_EXPONENT`; checked on the string, before any parse."""
    for m in _LITERAL.finditer(s):
        mantissa, exp = m.groups()
        if len(mantissa) - ("." in mantissa) > MAX_LITERAL_DIGITS:
            raise OverBudget(f"a number with more than {MAX_LITERAL_DIGITS} digits")
        if exp is not None and (len(exp) > 8 or abs(int(exp)) > MAX_LITERAL_EXPONENT):
            raise OverBudget(f"a decimal exponent e{exp} beyond +-{MAX_LITERAL_EXPONENT}")


def _parse(s: str, evaluate: bool):
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication,
        parse_expr,
        standard_transformations,
    )

    names = {c: sympy.Symbol(c) for c in "abcdefghijklmnopqrstuvwxyz"}
    names.update(sqrt=sympy.sqrt, pi=sympy.pi)
    allowed = {"Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational,
               "Symbol": sympy.Symbol, "Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow}
    return parse_expr(s, local_dict=names, global_dict=allowed, evaluate=evaluate,
                      transformations=(*standard_transformations, implicit_multiplication))


def _exact(e) -> Fraction | None:
    """The exact value of a numeric unevaluated tree whose cost is bounded, or None if it
    is not rational (roots, pi, floats)."""
    import sympy

    if isinstance(e, sympy.Rational):
        return Fraction(int(e.p), int(e.q))
    parts = [_exact(a) for a in e.args]
    if not e.args or any(v is None for v in parts):
        return None
    if isinstance(e, sympy.Add):
        return sum(parts, Fraction(0))
    if isinstance(e, sympy.Mul):
        out = Fraction(1)
        for v in parts:
            out *= v
        return out
    if isinstance(e, sympy.Pow) and parts[1].denominator == 1 and (parts[0] or parts[1] > 0):
        return parts[0] ** int(parts[1])
    return None


def expression_cost(e) -> tuple[float, int, int]:
    """``(bits, degree, terms)`` upper bounds of an UNEVALUATED sympy tree (``evaluate=False``)
    once evaluated and expanded; raises :class:`OverBudget` past :data:`MAX_BITS`,
    :data:`MAX_DEGREE`, :data:`MAX_TERMS`, or for a numeric exponent that is not a rational
    of magnitude and denominator <= :data:`MAX_EXPONENT` (towers, ``2^{10^6}``)."""
    import sympy

    if isinstance(e, sympy.Rational):
        cost = (int(e.p).bit_length() + int(e.q).bit_length(), 0, 1)
    elif isinstance(e, sympy.Float):
        cost = (64.0, 0, 1)
    elif isinstance(e, (sympy.Symbol, sympy.NumberSymbol)):
        cost = (2.0, 1, 1)
    elif isinstance(e, (sympy.Add, sympy.Mul)):
        parts = [expression_cost(a) for a in e.args]
        bits = sum(p[0] for p in parts)
        if isinstance(e, sympy.Add):
            cost = (bits, max(p[1] for p in parts), sum(p[2] for p in parts))
        else:
            terms = 1
            for p in parts:
                terms = min(terms * p[2], MAX_TERMS + 1)
            cost = (bits, sum(p[1] for p in parts), terms)
    elif isinstance(e, sympy.Pow):
        cost = _pow_cost(*e.args)
    else:
        raise OverBudget(f"{type(e).__name__} is not part of the answer grammar")
    if cost[0] > MAX_BITS or cost[1] > MAX_DEGREE or cost[2] > MAX_TERMS:
        raise OverBudget(f"expression too large (bits {cost[0]:.0f}, degree {cost[1]}, "
                         f"terms {cost[2]}; limits {MAX_BITS}, {MAX_DEGREE}, {MAX_TERMS})")
    return cost


def _pow_cost(base, exp) -> tuple[float, int, int]:
    b_bits, b_deg, b_terms = expression_cost(base)
    e_bits, _, _ = expression_cost(exp)
    if exp.free_symbols:  # x^n: sympy keeps it symbolic; its numbers must stay small
        if e_bits > 16 or b_bits > 64:
            raise OverBudget("a symbolic exponent with large numbers")
        return b_bits + e_bits, b_deg + 1, b_terms
    if e_bits > 32:
        raise OverBudget("a numeric exponent too large to evaluate (a tower?)")
    v = _exact(exp)
    if v is None or abs(v) > MAX_EXPONENT or v.denominator > MAX_EXPONENT:
        raise OverBudget(f"a numeric exponent {v if v is not None else exp} outside "
                         f"[-{MAX_EXPONENT}, {MAX_EXPONENT}] (or irrational)")
    k = max(1, math.ceil(abs(v)))
    # (t terms)^k expands to at most C(t + k - 1, k) monomials (a denominator alike)
    terms = math.comb(b_terms + k - 1, k) if v.denominator == 1 else b_terms
    return b_bits * k, b_deg * k, min(terms, MAX_TERMS + 1)


def _sympify(text: str):
    """The evaluated sympy expression of ``text``; None when it is not a whitelisted
    expression; raises :class:`OverBudget` when evaluating it would exceed the budget."""
    s = _symbolic_text(text)
    if s is None:
        return None
    lexical_budget(s)
    try:
        tree = _parse(s, evaluate=False)
    except Exception:  # noqa: BLE001 - any parse failure means "not an expression"
        return None
    expression_cost(tree)  # raises OverBudget before sympy evaluates anything
    try:
        return _parse(s, evaluate=True)
    except Exception:  # noqa: BLE001
        return None


def _equal(predicted: str, reference: str) -> bool:
    """:func:`answers_equal`, raising :class:`OverBudget`."""
    if len(predicted) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        raise OverBudget(f"an answer longer than {MAX_ANSWER_CHARS} characters")
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    ea, eb = _sympify(predicted), _sympify(reference)
    if ea is None or eb is None:
        return _normalise(predicted) == _normalise(reference) != ""
    import sympy

    diff = ea - eb
    if diff == 0:
        return True
    try:
        if _rational_probe(diff):
            return False  # nonzero at a rational point: not equal, no simplify needed
        return bool(sympy.simplify(diff) == 0)
    except Exception:  # noqa: BLE001
        return False


def _rational_probe(diff) -> bool:
    """True when ``diff`` (no roots, no pi) is exactly nonzero at a fixed rational point —
    the cheap proof of a wrong answer; False when that proves nothing."""
    import sympy

    if diff.has(sympy.pi) or any(isinstance(a, sympy.Pow) and not a.exp.is_Integer
                                 for a in sympy.preorder_traversal(diff)):
        return False
    point = {x: sympy.Rational(1009 + 7 * i, 13 + i) for i, x in enumerate(
        sorted(diff.free_symbols, key=str))}
    value = diff.subs(point)
    return bool(value.is_Rational and value != 0)


def answers_equal(predicted: str, reference: str) -> bool:
    """Numeric (exact) equality if both are numbers, else sympy ``simplify(a - b) == 0``;
    an answer over budget or out of time (module docstring) is never equal."""
    try:
        return _within_deadline(_equal, predicted, reference)
    except OverBudget:
        return False


def _within_deadline(fn, *args):
    """``fn(*args)`` under the hard limit :data:`MAX_SECONDS`; running out of time is
    :class:`OverBudget` (and a ``RuntimeWarning``). sympy is imported before the clock starts."""
    import sympy.parsing.sympy_parser  # noqa: F401 - the first import takes seconds

    try:
        with time_limit(MAX_SECONDS):
            return fn(*args)
    except TimeLimitExceeded as exc:
        warnings.warn(f"math reward: scoring an answer {exc}; it is scored as wrong and "
                      "counted in reward_over_budget", RuntimeWarning, stacklevel=3)
        raise OverBudget(str(exc)) from None


def _judge(got: str | None, ref: str) -> tuple[bool, bool]:
    """``(formatted, correct)`` of the extracted answer ``got``; raises :class:`OverBudget`."""
    formatted = got is not None and (parse_number(got) is not None or _sympify(got) is not None)
    return formatted, formatted and _equal(got, ref)  # type: ignore[arg-type]


@dataclass(frozen=True)
class MathRewardResult:
    """One scored response."""

    reward: float
    correct: bool
    formatted: bool
    extracted: str | None
    over_budget: bool = False
    """The answer was too large to parse or evaluate (scored wrong and unformatted)."""


def reference_answer(answer: str) -> str:
    """The reference answer scored against: ``answer``, or the content of its last
    ``\\boxed{...}``; raises ``ValueError`` when that is empty or unbalanced (``\\boxed{2``)."""
    ref = extract_boxed(answer) if _BOXED in answer else answer
    if ref is None or not ref.strip():
        raise ValueError(f"reference answer {answer!r} is empty or has an unbalanced \\boxed{{}}")
    return ref


def score_math(response: str, answer: str, format_bonus: float = 0.1,
               require_boxed: bool = False) -> MathRewardResult:
    """Score ``response`` against the reference ``answer`` (see the module docstring).

    ``answer`` may itself be ``\\boxed{...}``; ``reward = 1.0 * correct + format_bonus *
    formatted``. Bounded work whatever ``response`` holds (an over-budget answer scores 0).
    """
    if not 0.0 <= format_bonus <= 1.0:
        raise ValueError(f"format_bonus must be in [0, 1] (--qrl-task-format-bonus), got {format_bonus}")
    ref = reference_answer(answer)
    got = None
    try:
        got = _extract(response, require_boxed)
        formatted, correct = _within_deadline(_judge, got, ref)
    except OverBudget:
        return MathRewardResult(0.0, False, False, got, over_budget=True)
    return MathRewardResult(1.0 * correct + format_bonus * formatted, correct, formatted, got)


def math_reward(response: str, answer: str, format_bonus: float = 0.1,
                require_boxed: bool = False) -> float:
    """The reward of :func:`score_math` alone: 0, ``format_bonus`` or ``1 + format_bonus``."""
    return score_math(response, answer, format_bonus, require_boxed).reward
