"""``qrl-train --qrl-compare``: the same RL budget for each rollout format / loss, one table.

One supervised warm-up (plain forward) is run first (``<out>/sft``); every variant starts RL from its weights
with the same seed, prompts and step count, in ``<out>/<variant>``; the table (``compare.md``)
and the bar chart (``compare.png``) summarise the RL steps (final reward, mean KL(behav||prox),
max prox/behav ratio, clip fraction, error-token rate; ``utils.metrics.COMPARE_COLUMNS``).

Variants (issue 6, item 6): bf16 (ppo_clip), int8 + naive_quant, int8 + tis, int8 + acr,
int8 aligned + tbpo, nvfp4 aligned + tbpo. When the aligned forward is not installed the
aligned variants run the bf16 training forward and their label says so.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_qrl.rl.checkpoint import latest_checkpoint

__all__ = ["VARIANTS", "run_compare", "variant_argv"]

_TBPO = ["--qrl-loss-kind", "tbpo", "--qrl-loss-aggregation", "seq_mean_token_mean"]
VARIANTS: tuple[tuple[str, list[str]], ...] = (
    ("bf16", ["--qrl-rollout-format", "bf16", "--qrl-train-forward", "bf16",
              "--qrl-loss-kind", "ppo_clip"]),
    ("int8+naive_quant", ["--qrl-rollout-format", "int8", "--qrl-train-forward", "bf16",
                          "--qrl-loss-kind", "naive_quant"]),
    ("int8+tis", ["--qrl-rollout-format", "int8", "--qrl-train-forward", "bf16",
                  "--qrl-loss-kind", "tis"]),
    ("int8+acr", ["--qrl-rollout-format", "int8", "--qrl-train-forward", "bf16",
                  "--qrl-loss-kind", "acr"]),
    ("int8 aligned+tbpo", ["--qrl-rollout-format", "int8", "--qrl-train-forward", "aligned",
                           *_TBPO]),
    ("nvfp4 aligned+tbpo", ["--qrl-rollout-format", "nvfp4", "--qrl-train-forward", "aligned",
                            *_TBPO]),
)
"""(label, flags appended to the user's command line: later flags win)."""


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", label)


def variant_argv(argv: Sequence[str], flags: Sequence[str], out: Path) -> list[str]:
    """The command line of one variant."""
    return [*argv, *flags, "--qrl-sft-steps", "0", "--qrl-output-dir", str(out)]


def run_compare(argv: Sequence[str], parse: Callable[[list[str]], tuple[dict, dict]],
                run: Callable[..., list[dict]], out_dir: str | Path,
                log: Callable[[str], None] = print) -> tuple[Path, Path]:
    """Run the warm-up and every variant; write ``compare.md`` / ``compare.png`` in ``out_dir``.

    ``parse(argv) -> (configs, flags)`` validates a command line; ``run(configs, flags,
    start_weights=..., skip_sft=...)`` is :func:`megatron_qrl.rl.driver.run_job` (inside a
    megatron job).
    """
    from megatron_qrl.utils.metrics import compare_runs

    out = Path(out_dir)
    sft_dir = out / "sft"
    # the shared warm-up trains the BF16 masters with the plain forward (no rollouts)
    configs, flags = parse([*argv, "--qrl-steps", "0", "--qrl-train-forward", "bf16",
                            "--qrl-output-dir", str(sft_dir)])
    if configs["run"].sft_steps:
        log(f"[compare] supervised warm-up ({configs['run'].sft_steps} steps) -> {sft_dir}")
        run(configs, flags)
        state = torch.load(latest_checkpoint(sft_dir), map_location="cpu", weights_only=False)
        start = state["trainer"]["model"]
    else:
        start = None
    runs: dict[str, Any] = {}
    for label, extra in VARIANTS:
        vdir = out / _slug(label)
        configs, flags = parse(variant_argv(argv, extra, vdir))
        log(f"[compare] {label} -> {vdir}")
        runs[label] = run(configs, flags, start_weights=start, skip_sft=True)
    md, png = compare_runs(runs, out)
    log(f"[compare] table: {md}\n" + md.read_text())
    return md, png
