"""JSONL prompt datasets: one ``{"prompt": str, "answer": str | number}`` object per line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PromptRecord", "load_prompt_jsonl"]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt and its reference answer (numbers are kept as their JSON text)."""

    prompt: str
    answer: str


def _record(obj: object, where: str) -> PromptRecord:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object {{\"prompt\": ..., \"answer\": ...}}, "
                         f"got {type(obj).__name__}")
    missing = [k for k in ("prompt", "answer") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    prompt, answer = obj["prompt"], obj["answer"]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: \"prompt\" must be a non-empty string, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or answer == "":
        raise ValueError(f"{where}: \"answer\" must be a non-empty string or a number, got {answer!r}")
    return PromptRecord(prompt, answer if isinstance(answer, str) else json.dumps(answer))


def load_prompt_jsonl(path: str | Path, flag: str = "--qrl-task-prompts") -> list[PromptRecord]:
    """All records of the JSONL file ``path``; blank lines are skipped.

    Errors name the file, the 1-based line number and ``flag``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{flag} {p}: file not found (one JSON object per line with "
                                "\"prompt\" and \"answer\")")
    records = []
    with p.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{flag} {p}, line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            records.append(_record(obj, where))
    if not records:
        raise ValueError(f"{flag} {p}: no records (the file is empty)")
    return records
