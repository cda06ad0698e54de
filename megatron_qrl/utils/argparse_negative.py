"""Shim: argparse reads ``-1e-3`` / ``-inf`` / ``-nan`` after a flag as the flag's value.

(In utils, not compat: importing ``megatron_qrl.compat`` loads megatron-core, seconds a tool
should not spend before it parses its flags.)

Why: Python 3.11's argparse recognises only ``-1`` and ``-1.5`` as negative numbers
(``_ActionsContainer._negative_number_matcher = r'^-\\d+$|^-\\d*\\.\\d+$'``, set per parser in
``__init__``), so ``--qrl-lr -1e-3`` or ``--uaq-scale -1e-3`` fails with ``expected one
argument`` instead of reaching the flag's own check (later CPython releases widen the
pattern). The fix sets that (private, per-instance) attribute on
one parser; nothing global is patched. Versions: CPython 3.11 (harmless on later versions).
"""

from __future__ import annotations

import argparse
import re

__all__ = ["allow_negative_numbers"]

_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.I)


def allow_negative_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` read negative numbers in any float spelling as values; returns it."""
    parser._negative_number_matcher = _NEGATIVE_NUMBER
    return parser
