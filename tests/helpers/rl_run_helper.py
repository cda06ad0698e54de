"""``python tests/helpers/rl_run_helper.py [--double] ARGS``: qrl-train in a subprocess (tests only).

Default: the product path (the reference engine of ``--qrl-rollout-engine reference``);
``--double``: the test engine double of tests/helpers/rl_engine_double.py.
"""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
warnings.filterwarnings("ignore")

from megatron_qrl.rl.cli import main  # noqa: E402
from tests.helpers.rl_engine_double import tiny_engine_factory  # noqa: E402

if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack on stderr
    argv = sys.argv[1:]
    factory = None
    if argv[:1] == ["--double"]:
        argv, factory = argv[1:], tiny_engine_factory
    sys.exit(main(argv, engine_factory=factory))
