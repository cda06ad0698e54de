"""Synthetic verifiable task: multi-digit addition, deterministic per seed.

Noisy demonstrations (:func:`noisy_demos`, ``--qrl-task-demo-noise p``): each supervised
demonstration is, with probability ``p`` and independently of the others, the answer with a
spurious trailing ``0`` (``"357"`` -> ``"3570"``, ten times the sum: a consistent wrong habit
of some annotators that costs the model no extra arithmetic). The warm-up then learns the
sums and, after a sum, stops or writes the ``0`` about ``1 - p`` / ``p`` of the time; the
reward always checks the true answer, so RL has a reason, and a way, to drop the habit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..utils.io import atomic_write_text

NOISE_SUFFIX = "0"
"""Appended to a noisy demonstration (see the module docstring)."""

__all__ = ["NOISE_SUFFIX", "addition_problems", "count_addition_problems", "noisy_demos", "write_jsonl"]


def _check(digits_min: int, digits_max: int) -> None:
    if not 1 <= digits_min <= digits_max <= 18:
        raise ValueError(f"addition task: need 1 <= digits_min <= digits_max <= 18 "
                         f"(--qrl-task-digits-min/max), got {digits_min}, {digits_max}")


def _operands(digits_min: int, digits_max: int) -> int:
    return 10 ** digits_max - (10 ** (digits_min - 1) if digits_min > 1 else 0)


def count_addition_problems(digits_min: int, digits_max: int) -> int:
    """Number of distinct prompts ``a+b=`` with both operands in the digit range."""
    _check(digits_min, digits_max)
    return _operands(digits_min, digits_max) ** 2


def _operand(rng: random.Random, digits_min: int, digits_max: int) -> int:
    d = rng.randint(digits_min, digits_max)
    low = 0 if d == 1 else 10 ** (d - 1)
    return rng.randint(low, 10 ** d - 1)


def addition_problems(n: int, seed: int, digits_min: int = 1, digits_max: int = 3) -> list[dict]:
    """``n`` distinct addition problems ``{"prompt", "answer"}`` (see the module docstring)."""
    _check(digits_min, digits_max)
    total = count_addition_problems(digits_min, digits_max)
    if not 1 <= n <= total:
        raise ValueError(f"addition task: num_prompts={n} (--qrl-task-num-prompts) must be in "
                         f"[1, {total}] for {digits_min}..{digits_max} digits")
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    out = []
    while len(out) < n:
        a, b = _operand(rng, digits_min, digits_max), _operand(rng, digits_min, digits_max)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return out


def noisy_demos(answers: list[str], noise: float, seed: int) -> list[str]:
    """``answers`` with a ``0`` appended to each with probability ``noise``
    (``random.Random(seed)``, one draw per answer in order; ``noise == 0`` returns them
    unchanged)."""
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"--qrl-task-demo-noise must be in [0, 1], got {noise}")
    if noise == 0.0:
        return list(answers)
    rng = random.Random(seed)
    return [a + NOISE_SUFFIX if rng.random() < noise else a for a in answers]


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    """Write ``records`` one JSON object per line, atomically."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return atomic_write_text(path, text)
