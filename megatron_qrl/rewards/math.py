"""Verifiable math reward: extract the final answer, compare it, add a format bonus.

Reward (rlquant study, seed 003; ALGORITHMS.md section 4): ``1.0`` for a correct final
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
``+-*/^()``, ``sqrt``, ``pi``) with small integer exponents, so parsing is safe (no
attribute access, no names beyond the whitelist) and ``simplify`` stays fast; no timeout
is needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = [
    "MAX_SYMBOLIC_CHARS",
    "MathRewardResult",
    "answers_equal",
    "extract_answer",
    "extract_boxed",
    "extract_last_number",
    "math_reward",
    "parse_number",
    "score_math",
]

MAX_SYMBOLIC_CHARS = 64
"""Longest normalised answer handed to sympy."""

_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?![\d])"
    r"|(?:(?<![\w)\]}])-)?\.\d+"
)
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_SYMBOLIC_CHARS = re.compile(r"^[0-9a-z+\-*/^(). ]+$")
_WORDS = re.compile(r"[a-z]+")
_POWER = re.compile(r"\^(\([^()]*\)|-?\w+)")
_BOXED = "\\boxed"


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces kept); None if there
    is none or its braces never close."""
    start = text.rfind(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j].strip()
            return None  # unbalanced: the last \boxed is unreadable
        start = text.rfind(_BOXED, 0, start)
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (sign, thousands commas, decimals, ``a/b``), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(text: str, require_boxed: bool = False) -> str | None:
    """The final answer: last ``\\boxed{}`` content, else (unless ``require_boxed``) the
    last number."""
    boxed = extract_boxed(text)
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
    s = _normalise(text).replace(" ", "")
    frac = _FRAC.match(s)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or den is None or den == 0:
            return None
        return -num / den if frac.group(1) == "-" else num / den
    if "/" in s:
        num_s, _, den_s = s.partition("/")
        num, den = parse_number(num_s), parse_number(den_s)
        return None if num is None or den is None or den == 0 else num / den
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    return Fraction(s.replace(",", "").rstrip("."))


def _symbolic_text(text: str) -> str | None:
    """A whitelisted python-syntax form of ``text`` for sympy, or None if it is not safe."""
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
    powers = _POWER.findall(s)
    if len(powers) > 3 or any(not re.fullmatch(r"\(?(-?\d{1,2}|[a-z])\)?", p) for p in powers):
        return None  # no towers or huge exponents (9^9^9)
    return s.replace("^", "**")


def _sympify(text: str):
    s = _symbolic_text(text)
    if s is None:
        return None
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication,
        parse_expr,
        standard_transformations,
    )

    names = {c: sympy.Symbol(c) for c in "abcdefghijklmnopqrstuvwxyz"}
    names.update(sqrt=sympy.sqrt, pi=sympy.pi)
    try:
        return parse_expr(s, local_dict=names, global_dict={"Integer": sympy.Integer,
                          "Float": sympy.Float, "Rational": sympy.Rational, "Symbol": sympy.Symbol},
                          transformations=(*standard_transformations, implicit_multiplication))
    except Exception:  # noqa: BLE001 - any parse failure means "not an expression"
        return None


def answers_equal(predicted: str, reference: str) -> bool:
    """Numeric (exact) equality if both are numbers, else sympy ``simplify(a - b) == 0``."""
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    ea, eb = _sympify(predicted), _sympify(reference)
    if ea is None or eb is None:
        return _normalise(predicted) == _normalise(reference) != ""
    import sympy

    try:
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # noqa: BLE001
        return False


@dataclass(frozen=True)
class MathRewardResult:
    """One scored response."""

    reward: float
    correct: bool
    formatted: bool
    extracted: str | None


def score_math(response: str, answer: str, format_bonus: float = 0.1,
               require_boxed: bool = False) -> MathRewardResult:
    """Score ``response`` against the reference ``answer`` (see the module docstring).

    ``answer`` may itself be ``\\boxed{...}``; ``reward = 1.0 * correct + format_bonus *
    formatted``.
    """
    if not 0.0 <= format_bonus <= 1.0:
        raise ValueError(f"format_bonus must be in [0, 1] (--qrl-task-format-bonus), got {format_bonus}")
    ref = extract_boxed(answer) if _BOXED in answer else answer
    if ref is None or not ref.strip():
        raise ValueError(f"reference answer {answer!r} is empty or has an unbalanced \\boxed{{}}")
    got = extract_answer(response, require_boxed)
    formatted = got is not None and (parse_number(got) is not None or _sympify(got) is not None)
    correct = formatted and answers_equal(got, ref)  # type: ignore[arg-type]
    return MathRewardResult(1.0 * correct + format_bonus * formatted, correct, formatted, got)


def math_reward(response: str, answer: str, format_bonus: float = 0.1,
                require_boxed: bool = False) -> float:
    """The reward of :func:`score_math` alone: 0, ``format_bonus`` or ``1 + format_bonus``."""
    return score_math(response, answer, format_bonus, require_boxed).reward
