"""``qrl-train --qrl-compare [--qrl-seeds 1,2,3]``: the papers' variants on the same budget.

For each seed one supervised warm-up (plain forward) runs first (``<out>/seed<S>/sft``);
every variant starts RL from its weights with that seed, the same prompts and step count, in
``<out>/seed<S>/<variant>``. The report (``compare.md``, ``compare.png``,
:mod:`megatron_qrl.rl.compare_report`) gives each column as mean +- std over the seeds and
plots the accuracy curves with +-1 std bands.

Variants (the papers' claims they test are in docs/COMPARE.md):

* ``bf16``: BF16 rollouts and trainer, PPO-clip (the reference).
* ``int8 aligned+acr``: the default job's RL (tiny-cpu: INT8 W8A8 rollouts, aligned forward,
  ACR), from the compare's warm-up.
* ``w4a16 naive``: W4A16 rollouts (int4 weights, group 128), BF16 trainer forward, the
  naive ratio pi_theta / pi_behav (QuRL eq. 3).
* ``w4a16 tis`` / ``w4a16 acr``: the same with the decoupled objective and TIS (QuRL eq. 5)
  / ACR (QuRL eq. 7-9), cap C = 2.
* ``w4a16 aligned+tbpo``: the trainer computes with the rollout's W4A16 weights (QaRL's
  aligned forward) and TBPO (QaRL, sequence level).
* ``w4a16 tis+aqn``: ``w4a16 tis`` with AQN on the rollout copy (QeRL); its pair is
  ``w4a16 tis`` (AQN off).
* ``int8 low-lr`` / ``int8 low-lr+uaq``: INT8 W8A8 rollouts, ACR, lr :data:`LOW_LR`, UAQ
  s = 1.5 off / on (QuRL eq. 10-12: QuRL uses UAQ at lr < 1e-5 only).
* LoRA (the full-parameter reference is ``bf16``): ``bf16 lora ppo_clip`` (LoRA
  r = 32, alpha = 32 on all seven projections, BF16 base / rollouts / trainer);
  ``bf16 qlora-nf4 ppo_clip`` (rlquant's QLoRA: NF4 double-quantized frozen base, r = 8,
  alpha = 16, dropout 0.05, lr 1e-4, BF16 rollouts); ``nvfp4 lora aligned+tis+aqn`` (QeRL:
  NVFP4 rollouts and frozen base = the aligned forward, LoRA r = 32 alpha = 32, TIS, AQN).

``--qrl-compare rlquant`` runs :data:`RLQUANT_VARIANTS` instead, then evaluates every final
policy at the precision it deploys at (:mod:`megatron_qrl.rl.compare_rlquant`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_qrl.config.job import parse_seeds
from megatron_qrl.rl.checkpoint import CKPT_DIR, latest_checkpoint

__all__ = ["LOW_LR", "RLQUANT_VARIANTS", "VARIANTS", "VariantSet", "parse_seeds", "report_from_dirs",
           "run_compare", "slug", "variant_argv", "variants_for_mode"]

LOW_LR = 3e-6
"""Learning rate of the UAQ pair (below QuRL's UAQ limit of 1e-5)."""

_W4 = ["--qrl-rollout-format", "w4a16", "--qrl-train-forward", "bf16"]
_INT8_LOW = ["--qrl-rollout-format", "int8", "--qrl-train-forward", "bf16", "--qrl-loss-kind",
             "acr", "--qrl-lr", str(LOW_LR)]
_LORA32 = ["--qrl-lora-rank", "32", "--qrl-lora-alpha", "32"]
VARIANTS: tuple[tuple[str, list[str]], ...] = (
    ("bf16", ["--qrl-rollout-format", "bf16", "--qrl-train-forward", "bf16",
              "--qrl-loss-kind", "ppo_clip"]),
    ("int8 aligned+acr", ["--qrl-rollout-format", "int8", "--qrl-train-forward", "aligned",
                          "--qrl-loss-kind", "acr"]),
    ("w4a16 naive", [*_W4, "--qrl-loss-kind", "naive_quant"]),
    ("w4a16 tis", [*_W4, "--qrl-loss-kind", "tis"]),
    ("w4a16 acr", [*_W4, "--qrl-loss-kind", "acr"]),
    ("w4a16 aligned+tbpo", ["--qrl-rollout-format", "w4a16", "--qrl-train-forward", "aligned",
                            "--qrl-loss-kind", "tbpo", "--qrl-loss-aggregation",
                            "seq_mean_token_mean"]),
    ("w4a16 tis+aqn", [*_W4, "--qrl-loss-kind", "tis", "--qrl-aqn-enabled"]),
    ("int8 low-lr", [*_INT8_LOW, "--qrl-uaq-scale", "1.0"]),
    ("int8 low-lr+uaq", [*_INT8_LOW, "--qrl-uaq-scale", "1.5"]),
    ("bf16 lora ppo_clip", ["--qrl-rollout-format", "bf16", "--qrl-train-forward", "bf16",
                            "--qrl-loss-kind", "ppo_clip", *_LORA32]),
    ("bf16 qlora-nf4 ppo_clip", ["--qrl-rollout-format", "bf16", "--qrl-train-forward", "bf16",
                                 "--qrl-loss-kind", "ppo_clip", "--qrl-lora-rank", "8",
                                 "--qrl-lora-alpha", "16", "--qrl-lora-dropout", "0.05",
                                 "--qrl-lora-base-format", "nf4", "--qrl-lr", "1e-4"]),
    ("nvfp4 lora aligned+tis+aqn", ["--qrl-rollout-format", "nvfp4", "--qrl-train-forward",
                                    "aligned", "--qrl-loss-kind", "tis", "--qrl-aqn-enabled",
                                    *_LORA32, "--qrl-lora-base-format", "nvfp4"]),
)
"""(label, flags appended to the user's command line: later flags win)."""


_GRPO = ["--qrl-loss-kind", "ppo_clip", "--qrl-loss-aggregation", "seq_mean_token_mean"]
RLQUANT_VARIANTS: tuple[tuple[str, list[str]], ...] = (
    ("bf16 grpo", ["--qrl-rollout-format", "bf16", "--qrl-train-forward", "bf16", *_GRPO]),
    ("qaft int8", ["--qrl-rollout-format", "int8", "--qrl-train-forward", "aligned", *_GRPO]),
    ("qaft w4a16", ["--qrl-rollout-format", "w4a16", "--qrl-train-forward", "aligned", *_GRPO]),
    ("qlora nf4", ["--qrl-rollout-format", "bf16", "--qrl-train-forward", "bf16", *_GRPO,
                   "--qrl-lora-rank", "8", "--qrl-lora-alpha", "16", "--qrl-lora-dropout", "0.05",
                   "--qrl-lora-base-format", "nf4", "--qrl-lr", "1e-4"]),
)
"""The rlquant study's RL runs (plain GRPO = PPO-clip, sequence-mean aggregation, for all):
full precision (PTQ starts from its last checkpoint), QAFT-STE as the aligned forward at INT8
and W4A16, QLoRA (NF4 double-quantized frozen base, r = 8, alpha = 16, dropout 0.05, lr 1e-4)."""


@dataclass(frozen=True)
class VariantSet:
    """One ``--qrl-compare`` set: its RL variants and what runs after all seeds' RL runs,
    ``after(out_dir, seed_dirs, log)`` (e.g. the rlquant PTQ evaluation), or None."""

    variants: tuple[tuple[str, list[str]], ...]
    after: Callable[[Path, list[Path], Callable[[str], None]], object] | None = None


def slug(label: str) -> str:
    """A variant label as a directory name."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", label)


def variant_argv(argv: Sequence[str], flags: Sequence[str], out: Path) -> list[str]:
    """The command line of one variant."""
    return [*argv, *flags, "--qrl-sft-steps", "0", "--qrl-output-dir", str(out)]


def _warm_up(argv: list[str], parse: Callable, run: Callable, sft_dir: Path,
             log: Callable[[str], None]) -> dict | None:
    """The shared supervised warm-up of one seed (plain forward, no rollouts): its weights."""
    configs, flags = parse([*argv, "--qrl-steps", "0", "--qrl-train-forward", "bf16",
                            "--qrl-output-dir", str(sft_dir)])
    if not configs.run.sft_steps:
        return None
    log(f"[compare] supervised warm-up ({configs.run.sft_steps} steps) -> {sft_dir}")
    run(configs, flags)
    state = torch.load(latest_checkpoint(sft_dir), map_location="cpu", weights_only=False)
    return state["trainer"]["model"]


def _with_visible_updates(records: list[dict], vdir: Path, spec: Any) -> list[dict]:
    """``records`` with :data:`~megatron_qrl.rl.compare_report.VISIBLE_KEY` in a copy of the
    last one: the visible fraction of the update between the run's last two checkpoints."""
    from megatron_qrl.rl.compare_report import VISIBLE_KEY, visible_update_fraction

    ckpts = sorted((vdir / CKPT_DIR).glob("step_*.pt")) if (vdir / CKPT_DIR).is_dir() else []
    if len(ckpts) < 2 or not records:
        return records
    states = [torch.load(p, map_location="cpu", weights_only=False)["trainer"]["model"]
              for p in ckpts[-2:]]
    return [*records[:-1], {**records[-1], VISIBLE_KEY: visible_update_fraction(*states, spec)}]


def variants_for_mode(mode: str, variants: tuple[tuple[str, list[str]], ...] = VARIANTS,
                      log: Callable[[str], None] = print) -> tuple[tuple[str, list[str]], ...]:
    """The ``variants`` that ``--qrl-mode mode`` can run: the Ray modes' engine actor serves no
    LoRA adapters yet (``rl.cli`` refuses LoRA there), so they leave the LoRA variants out,
    saying so."""
    if mode == "single":
        return variants
    kept = tuple(v for v in variants if "--qrl-lora-rank" not in v[1])
    left = [label for label, extra in variants if "--qrl-lora-rank" in extra]
    if left:
        log(f"[compare] --qrl-mode {mode}: the LoRA variants run in --qrl-mode single only; "
            f"left out: {', '.join(left)}")
    return kept


def run_compare(argv: Sequence[str], parse: Callable[[list[str]], tuple[dict, dict]],
                run: Callable[..., list[dict]], out_dir: str | Path,
                log: Callable[[str], None] = print,
                seeds: Sequence[int | None] = (None,),
                variants: Sequence[tuple[str, list[str]]] = VARIANTS,
                after: Callable[[Path, list[Path], Callable[[str], None]], object] | None = None,
                ) -> tuple[Path, Path]:
    """Run the warm-up and every variant for every seed; write ``compare.md`` /
    ``compare.png`` in ``out_dir`` (:func:`megatron_qrl.rl.compare_report.write_report`).

    ``parse(argv) -> (configs, flags)`` validates a command line; ``run(configs, flags,
    start_weights=..., skip_sft=...)`` is :func:`megatron_qrl.rl.driver.run_job` (inside a
    megatron job). ``seeds``: None = the command line's ``--qrl-seed``. ``after``: see
    :class:`VariantSet`, called with the seeds' output directories once every run is done.
    """
    from megatron_qrl.rl.compare_report import write_report

    out = Path(out_dir)
    runs: dict[str, dict[str, list[dict]]] = {}
    seed_dirs: list[Path] = []
    for seed in seeds:
        s_argv = list(argv) if seed is None else [*argv, "--qrl-seed", str(seed)]
        s_out = out if seed is None else out / f"seed{seed}"
        seed_dirs.append(s_out)
        start = _warm_up(s_argv, parse, run, s_out / "sft", log)
        for label, extra in variants:
            vdir = s_out / slug(label)
            configs, flags = parse(variant_argv(s_argv, extra, vdir))
            log(f"[compare] seed {configs.run.seed}: {label} -> {vdir}")
            records = _with_visible_updates(
                run(configs, flags, start_weights=start, skip_sft=True), vdir,
                configs.rollout.spec)
            runs.setdefault(label, {})[str(configs.run.seed)] = records
    md, png = write_report(runs, out)
    log(f"[compare] table: {md}\n" + md.read_text())
    if after is not None:
        after(out, seed_dirs, log)
    return md, png


def report_from_dirs(seed_dirs: Sequence[str | Path], out_dir: str | Path,
                     variants: Sequence[tuple[str, list[str]]] = VARIANTS) -> tuple[Path, Path]:
    """The report of finished compare runs on disk: each of ``seed_dirs`` holds one seed's
    variant directories (``<dir>/<variant>`` or ``<dir>/seed<S>/<variant>``), e.g. seeds run
    as separate processes (``--qrl-seeds 1``, ``--qrl-seeds 2``, ...) to use several cores."""
    from megatron_qrl.quant import get_spec
    from megatron_qrl.rl.compare_report import write_report
    from megatron_qrl.utils.metrics import read_metrics

    runs: dict[str, dict[str, list[dict]]] = {}
    for d in map(Path, seed_dirs):
        for sub in [d, *sorted(d.glob("seed*"))]:
            for label, extra in variants:
                vdir = sub / slug(label)
                if not (vdir / "metrics.jsonl").is_file():
                    continue
                fmt = extra[extra.index("--qrl-rollout-format") + 1]
                records = _with_visible_updates(read_metrics(vdir), vdir, get_spec(fmt))
                runs.setdefault(label, {})[sub.name.removeprefix("seed")] = records
    if not runs:
        raise FileNotFoundError(f"no compare runs (<variant>/metrics.jsonl) under {seed_dirs}")
    return write_report(runs, out_dir)
