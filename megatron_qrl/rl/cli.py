"""``qrl-train``: the standalone single-process RL job (no Ray), and ``--qrl-compare``.

    qrl-train                                   # = --qrl-preset tiny-cpu (the CPU default job)
    qrl-train --qrl-preset tiny-cpu --qrl-seed 7 --qrl-output-dir runs/s7
    qrl-train --qrl-preset tiny-cpu --qrl-compare --qrl-output-dir runs/compare

Every ``--qrl-*`` flag of :func:`megatron_qrl.config.add_qrl_args` applies. Launcher-only
flags: ``--qrl-compare`` (run the compare variants, see :mod:`.compare`), ``--qrl-mode``
(``single``, or the Ray modes ``colocated`` / ``disaggregated`` of :mod:`.ray_modes`: the
rollout engine in a Ray actor, the trainer in this process), ``--qrl-no-progress``.
Megatron flags after ``--`` (model shape, TP/EP, see examples/run_qwen3_30b_a3b.sh) are
refused until a Megatron-flag trainer exists.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from megatron_qrl.config import QrlArgumentError, add_qrl_args, effective_values, validate_qrl_args

__all__ = ["build_parser", "main", "parse_configs"]

DEFAULT_PRESET = "tiny-cpu"
MODES = ("single", "colocated", "disaggregated")


def build_parser() -> argparse.ArgumentParser:
    """The ``qrl-train`` parser: every ``--qrl-*`` flag plus the launcher flags."""
    parser = argparse.ArgumentParser(
        prog="qrl-train", allow_abbrev=False,
        description="megatron_qrl RL job: SFT warm-up + RL with quantized rollouts "
                    f"(default --qrl-preset {DEFAULT_PRESET})")
    add_qrl_args(parser)
    launch = parser.add_argument_group("qrl-train launcher")
    launch.add_argument("--qrl-compare", action="store_true",
                        help="run the same RL budget for bf16, int8+naive_quant, int8+tis, "
                             "int8+acr, int8 aligned+tbpo, nvfp4 aligned+tbpo and write "
                             "compare.md / compare.png in the output directory")
    launch.add_argument("--qrl-mode", choices=MODES, default="single",
                        help="single: one process, reference engine (CPU default). colocated "
                             "/ disaggregated: rollout engine in a Ray actor (same / own "
                             "placement-group bundle), trainer in this process")
    launch.add_argument("--qrl-no-progress", action="store_true", help="no progress bar")
    return parser


def _with_default_preset(argv: Sequence[str]) -> list[str]:
    argv = list(argv)
    if not any(a == "--qrl-preset" or a.startswith("--qrl-preset=") for a in argv):
        argv = ["--qrl-preset", DEFAULT_PRESET, *argv]
    return argv


def parse_configs(argv: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any], argparse.Namespace]:
    """``(configs, effective flag values, namespace)`` of a ``qrl-train`` command line.

    Raises :class:`QrlArgumentError` (one message naming the flags) on bad values.
    """
    argv = list(argv)
    megatron_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(_with_default_preset(argv))
    args.megatron_argv = megatron_argv
    configs = validate_qrl_args(args)
    flags = effective_values(args)
    if megatron_argv:
        raise QrlArgumentError(
            f"Megatron flags after '--' ({' '.join(megatron_argv[:4])} ...): qrl-train's "
            f"trainer (--qrl-mode {args.qrl_mode} too) builds the model from --qrl-model; a "
            "Megatron-flag trainer is not implemented yet, drop the flags after '--'")
    if args.qrl_compare and configs["run"].resume:
        raise QrlArgumentError("--qrl-compare cannot be combined with --qrl-resume (each "
                               "variant starts from the shared warm-up); drop one of them")
    return configs, flags, args


def main(argv: Sequence[str] | None = None, engine_factory: Any = None) -> int:
    """Entry point of the ``qrl-train`` console script."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        configs, flags, args = parse_configs(argv)
    except QrlArgumentError as exc:
        build_parser().error(str(exc))
    from megatron_qrl.rl.driver import run_job
    from megatron_qrl.rl.forward import ForwardUnavailableError
    from megatron_qrl.rl.sync import make_engine

    factory = engine_factory or make_engine
    progress = not args.qrl_no_progress

    def run(cfg: dict, fl: dict, **kw: Any) -> list[dict]:
        return run_job(cfg, fl, engine_factory=factory, progress=progress, **kw)

    try:
        if args.qrl_mode == "single":
            _launch(args, configs, flags, argv, run)
        else:
            from megatron_qrl.rl.ray_modes import RaySession

            with RaySession(args.qrl_mode) as session:
                factory = engine_factory or session.engine_factory
                _launch(args, configs, flags, argv, run)
    except (FileExistsError, FileNotFoundError, NotImplementedError, QrlArgumentError,
            ForwardUnavailableError) as exc:  # user-fixable: one line, no traceback
        print(f"qrl-train: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _launch(args: argparse.Namespace, configs: dict, flags: dict, argv: list[str],
            run: Any) -> None:
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        if args.qrl_compare:
            from megatron_qrl.rl.compare import run_compare

            base = [a for a in _with_default_preset(argv) if a != "--qrl-compare"]

            def parse(v: list[str]) -> tuple[dict, dict]:
                return parse_configs(v)[:2]

            out = configs["run"].output_dir or configs["run"].resolved_output_dir() + "-compare"
            run_compare(base, parse, run, out)
        else:
            records = run(configs, flags)
            _summary(records)


def _summary(records: Sequence[dict]) -> None:
    rl = [r for r in records if r["phase"] == "rl"]
    if not rl:
        return
    k = max(1, min(5, len(rl) // 4))
    first = sum(r["reward_mean"] for r in rl[:k]) / k
    last = sum(r["reward_mean"] for r in rl[-k:]) / k
    print(f"[qrl-train] reward (mean of {k} RL steps): start {first:.3f} -> end {last:.3f}")


if __name__ == "__main__":
    sys.exit(main())
