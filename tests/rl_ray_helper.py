"""``python tests/rl_ray_helper.py [--kill-at N] [--calls FILE] ARGS``: qrl-train (tests only).

Runs ``qrl-train ARGS`` (a Ray mode; ``RAY_ADDRESS`` names the test's cluster) with two test
hooks on the engine actor proxy: ``--kill-at N`` ``ray.kill``s the actor just before the
N-th ``generate`` call (1-based, over the whole run), ``--calls FILE`` writes the call log of
each actor (generate / release_memory / resume_memory, in order) as JSON lines when it is
shut down, plus the number of restarts.
"""

import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

from megatron_qrl.rl.cli import main  # noqa: E402
from megatron_qrl.rl.ray_modes import RayRolloutEngine  # noqa: E402
from megatron_qrl.rollout.ray_actor import RayEngine  # noqa: E402


def _pop(argv: list[str], flag: str) -> str | None:
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def _install_hooks(kill_at: int | None, calls: str | None) -> None:
    import ray

    generate, shutdown = RayEngine.generate, RayRolloutEngine.shutdown
    count = [0]

    def killing_generate(self, prompts, sampling):
        count[0] += 1
        if count[0] == kill_at:
            ray.kill(self.actor, no_restart=True)
        return generate(self, prompts, sampling)

    def logging_shutdown(self):
        if calls is not None:
            with open(calls, "a") as f:
                f.write(json.dumps({"calls": self.actor.call_log(),
                                    "restarts": self.restarts}) + "\n")
        shutdown(self)

    RayEngine.generate = killing_generate
    RayRolloutEngine.shutdown = logging_shutdown


if __name__ == "__main__":
    argv = sys.argv[1:]
    kill_at, calls = _pop(argv, "--kill-at"), _pop(argv, "--calls")
    _install_hooks(int(kill_at) if kill_at else None, calls)
    sys.exit(main(argv))
