"""Verifiable rewards for RL: math answers (``\\boxed{}`` or last number, numeric/symbolic)."""

from .math import (
    MathRewardResult,
    answers_equal,
    extract_answer,
    extract_boxed,
    extract_last_number,
    math_reward,
    parse_number,
    score_math,
)

__all__ = [
    "MathRewardResult",
    "answers_equal",
    "extract_answer",
    "extract_boxed",
    "extract_last_number",
    "math_reward",
    "parse_number",
    "score_math",
]
