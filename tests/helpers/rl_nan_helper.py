"""``python tests/helpers/rl_nan_helper.py MARKER ARGS``: qrl-train (engine double) with a NaN injected
into a gradient once RL starts (tests only).

Every gradient of the policy's first parameter becomes NaN from the first RL step on (a
tensor hook, before megatron's grad accumulation). Every weight sync the engine receives is
checked: a non-finite float tensor writes ``MARKER`` (the test asserts it never exists).
"""

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import megatron_qrl.rl.driver as driver  # noqa: E402
from megatron_qrl.rl.cli import main  # noqa: E402
from tests.helpers.rl_engine_double import TinyEngine  # noqa: E402

STATE = {"rl": False}


def _poison(policy):
    param = next(policy.ddp.module.parameters())
    param.register_hook(lambda g: g * float("nan") if STATE["rl"] else g)
    return policy


def _patch(marker: Path):
    build, start_rl = driver.build_policy, driver._start_rl

    def build_policy(*a, **k):
        return _poison(build(*a, **k))

    def begin_rl(*a, **k):
        STATE["rl"] = True
        return start_rl(*a, **k)

    driver.build_policy, driver._start_rl = build_policy, begin_rl

    class CheckedEngine(TinyEngine):
        def update_weights(self, named_tensors, version):
            tensors = list(named_tensors)
            if any(t.is_floating_point() and not torch.isfinite(t).all() for _, t in tensors):
                marker.write_text(f"non-finite weights synced as version {version}\n")
            return super().update_weights(tensors, version)

    return lambda cfg, hf_config, seed: CheckedEngine(hf_config, cfg.format, seed)


if __name__ == "__main__":
    factory = _patch(Path(sys.argv[1]))
    sys.exit(main(sys.argv[2:], engine_factory=factory))
