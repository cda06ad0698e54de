"""Helpers shared by several test folders; the ``rl_*_helper.py`` scripts also run by path
(``python tests/helpers/rl_run_helper.py ...``, torchrun entry points)."""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[1]
RL_RUN_HELPER = HELPERS / "rl_run_helper.py"
