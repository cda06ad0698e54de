"""JSONL prompt datasets: one ``{"prompt": str, "answer": str | number}`` object per line."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_qrl.rewards.math import reference_answer

__all__ = ["PromptFileError", "PromptRecord", "load_prompt_jsonl"]


class PromptFileError(ValueError):
    """A malformed prompts file; the message names the file, the line and the flag."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt and its reference answer (numbers are kept as their JSON text)."""

    prompt: str
    answer: str


def _record(obj: object, where: str) -> PromptRecord:
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: expected a JSON object {{\"prompt\": ..., "
                              f"\"answer\": ...}}, got {type(obj).__name__}")
    missing = [k for k in ("prompt", "answer") if k not in obj]
    if missing:
        raise PromptFileError(f"{where}: missing key(s) {', '.join(missing)}")
    prompt, answer = obj["prompt"], obj["answer"]
    if not isinstance(prompt, str) or not prompt:
        raise PromptFileError(f"{where}: \"prompt\" must be a non-empty string, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or answer == "" \
            or (isinstance(answer, float) and not math.isfinite(answer)):
        raise PromptFileError(f"{where}: \"answer\" must be a non-empty string or a finite "
                              f"number, got {answer!r}")
    answer = answer if isinstance(answer, str) else json.dumps(answer)
    try:
        reference_answer(answer)  # what the reward will score against, checked before training
    except ValueError as exc:
        raise PromptFileError(f"{where}: \"answer\" cannot be scored: {exc}; close the "
                              "\\boxed{...} or give the plain answer") from None
    return PromptRecord(prompt, answer)


def load_prompt_jsonl(path: str | Path, flag: str = "--qrl-task-prompts") -> list[PromptRecord]:
    """All records of the JSONL file ``path``; blank lines are skipped.

    Errors name the file, the 1-based line number and ``flag``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{flag} {p}: file not found (one JSON object per line with "
                                "\"prompt\" and \"answer\")")
    records = []
    with p.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{flag} {p}, line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PromptFileError(f"{where}: not UTF-8 text (byte {exc.start + 1}); save "
                                      "the file as UTF-8 JSONL") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptFileError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            records.append(_record(obj, where))
    if not records:
        raise PromptFileError(f"{flag} {p}: no records (the file is empty)")
    return records
