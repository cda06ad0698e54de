"""``python tests/rl_run_helper.py ARGS``: qrl-train with the test engine double (tests only)."""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

from rl_engine_double import tiny_engine_factory  # noqa: E402

from megatron_qrl.rl.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], engine_factory=tiny_engine_factory))
