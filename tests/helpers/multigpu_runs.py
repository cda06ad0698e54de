"""The qrl-train command lines of tests/gpu/test_multigpu_sglang.py (2 GPUs), shared
with their CPU check (tests/rl/test_multigpu_commands.py: the flags pass qrl-train's checks)."""

from __future__ import annotations

import sys

STEPS = 2
LAYOUTS = {  # name: (torchrun ranks, engines, --qrl-* flags, Megatron flags)
    "engine-tp2": (1, 1, ["--qrl-rollout-engine-tp", "2", "--qrl-rollout-format", "bf16",
                          "--qrl-train-forward", "bf16"], []),
    "ep2-fleet2": (2, 2, ["--qrl-rollout-num-engines", "2"],
                   ["--expert-model-parallel-size", "2"]),
}
"""``engine-tp2``: one trainer process, one engine of TP 2 over both GPUs (BF16 rollouts);
``ep2-fleet2``: torchrun 2 ranks at EP 2, two engines of TP 1 (one per GPU)."""


def qrl_args(layout: str, out: str) -> list[str]:
    """The qrl-train arguments (after ``-m megatron_qrl.rl.cli``) of ``layout``."""
    _, _, qrl, megatron = LAYOUTS[layout]
    return ["--qrl-preset", "tiny-cpu", "--qrl-mode", "colocated",
            "--qrl-rollout-engine", "sglang", "--qrl-rollout-sglang-mem-fraction", "0.3",
            "--qrl-sft-steps", "20", "--qrl-steps", str(STEPS), "--qrl-save-interval", "-1",
            "--qrl-no-progress", "--qrl-output-dir", out, *qrl, "--", *megatron]


def launcher(layout: str, port: int) -> list[str]:
    """The process that runs ``layout``: the CLI module, or torchrun's ranks of it."""
    ranks = LAYOUTS[layout][0]
    if ranks == 1:
        return [sys.executable, "-m", "megatron_qrl.rl.cli"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "-m",
            "megatron_qrl.rl.cli"]
