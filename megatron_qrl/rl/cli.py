"""``qrl-train``: the standalone RL job (one process, or torchrun ranks), and ``--qrl-compare``.

    qrl-train                                   # = --qrl-preset tiny-cpu (the CPU default job)
    qrl-train --qrl-preset tiny-cpu --qrl-seed 7 --qrl-output-dir runs/s7
    qrl-train --qrl-preset tiny-cpu --qrl-compare --qrl-output-dir runs/compare

Every ``--qrl-*`` flag of :func:`megatron_qrl.config.add_qrl_args` applies. Launcher-only
flags: those of :class:`~megatron_qrl.config.job.JobConfig` (generated from its fields, its
rules checked by it) — ``--qrl-compare`` (run the compare variants, see :mod:`.compare`),
``--qrl-seeds``, ``--qrl-mode`` (``single``, or the Ray modes ``colocated`` /
``disaggregated`` of :mod:`.ray_modes`: the rollout engine in a Ray actor, the trainer in
this process or in torchrun's ranks, rank 0 alone talking to Ray) — and
``--qrl-no-progress``.

Megatron-LM flags after ``--`` (a documented subset with Megatron's names and defaults, see
:mod:`megatron_qrl.config.megatron_flags`): ``--lr``, ``--seed``, ``--micro-batch-size``,
``--global-batch-size``, ``--train-iters``, ``--load``, ``--save``, ``--save-interval``
become the matching ``--qrl-*`` values (a ``--qrl-*`` flag saying otherwise is an error
naming both); model-shape flags override the tiny model's shape or must agree with the
checkpoint; ``--tensor-model-parallel-size`` / ``--expert-model-parallel-size`` /
``--expert-tensor-parallel-size`` / ``--sequence-parallel`` set the trainer's layout for a
multi-rank run under torchrun (rank 0 owns the rollout engine — in-process, or a Ray actor
with ``--qrl-mode colocated|disaggregated`` — and the outputs)::

    torchrun --nproc-per-node 2 -m megatron_qrl.rl.cli --qrl-model tiny-dense --qrl-routing-replay off \
        -- --tensor-model-parallel-size 2 --group-query-attention --num-query-groups 2
    torchrun --nproc-per-node 2 -m megatron_qrl.rl.cli -- --expert-model-parallel-size 2
    torchrun --nproc-per-node 2 -m megatron_qrl.rl.cli --qrl-mode disaggregated \
        -- --expert-model-parallel-size 2

``--bf16`` trains BF16 parameters with fp32 master weights. Flags without an effect in this
build (virtual pipeline stages, --fp16, ...) are errors naming the flag, as are unknown ones.
Pipeline parallelism (``-- --pipeline-model-parallel-size 2``, ``rl.pipeline``) runs
megatron-core's 1F1B schedule on padded micro batches.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from megatron_qrl.config import (
    QrlArgumentError,
    add_qrl_args,
    effective_values,
    qrl_configs_from_args,
    validate_qrl_args,
)
from megatron_qrl.config.configs import QrlConfigs
from megatron_qrl.config.generator import add_group_args
from megatron_qrl.config.job import COMPARE_SETS, MODES, JobConfig, job_group
from megatron_qrl.config.moe_path import check_moe_flags
from megatron_qrl.utils.cli import allow_negative_numbers, debug_enabled, disk_error, one_line_error
from megatron_qrl.utils.ranks import rank_label

__all__ = ["COMPARE_SETS", "MODES", "build_parser", "main", "parse_configs"]

DEFAULT_PRESET = "tiny-cpu"


def build_parser() -> argparse.ArgumentParser:
    """The ``qrl-train`` parser: every ``--qrl-*`` flag plus the launcher flags."""
    parser = allow_negative_numbers(argparse.ArgumentParser(
        prog="qrl-train", allow_abbrev=False,
        description="megatron_qrl RL job: SFT warm-up + RL with quantized rollouts "
                    f"(default --qrl-preset {DEFAULT_PRESET})"))  # --qrl-lr -1e-3: a value
    add_qrl_args(parser)
    launch = parser.add_argument_group("qrl-train launcher")
    add_group_args(launch, job_group())
    launch.add_argument("--qrl-no-progress", action="store_true", help="no progress bar")
    launch.add_argument("--debug", action="store_true",
                        help="show the traceback behind an error (also: env QRL_DEBUG=1)")
    return parser


def _with_default_preset(argv: Sequence[str]) -> list[str]:
    argv = list(argv)
    if not any(a == "--qrl-preset" or a.startswith("--qrl-preset=") for a in argv):
        argv = ["--qrl-preset", DEFAULT_PRESET, *argv]
    return argv


def _megatron_rewrites(argv: list[str], megatron_argv: list[str]) -> tuple[list[str], Any]:
    """``(qrl argv + the --qrl-* rewrites of the Megatron flags, MegatronSettings)``.

    A ``--qrl-*`` flag given explicitly with another value than its Megatron twin is one
    error naming both.
    """
    from megatron_qrl.config.generator import explicit_dests
    from megatron_qrl.config.megatron_flags import MegatronSettings, parse_megatron_flags

    if not megatron_argv:
        return argv, MegatronSettings()
    settings, rewrites, global_batch = parse_megatron_flags(megatron_argv)
    parser = build_parser()
    first = parser.parse_args(_with_default_preset(argv))
    explicit, values = explicit_dests(first), effective_values(first)
    out = list(argv)
    for mflag, qflag, value in rewrites:
        dest = qflag[2:].replace("-", "_")
        if dest in explicit and values[dest] != value:
            raise QrlArgumentError(f"{mflag} {value} and {qflag} {values[dest]} say different "
                                   "things; drop one of them")
        out += [qflag, str(value)]
    if global_batch is not None:
        values = effective_values(parser.parse_args(_with_default_preset(out)))
        n, updates = values["qrl_rollout_n_samples_per_prompt"], values["qrl_updates_per_step"]
        if (global_batch * updates) % n:
            raise QrlArgumentError(
                f"--global-batch-size {global_batch} (samples per optimizer step) x "
                f"--qrl-updates-per-step {updates} is not a multiple of "
                f"--qrl-rollout-n-samples-per-prompt {n}; pick a global batch size that is")
        prompts = global_batch * updates // n
        if "qrl_prompts_per_step" in explicit and values["qrl_prompts_per_step"] != prompts:
            raise QrlArgumentError(
                f"--global-batch-size {global_batch} means {prompts} prompts per step "
                f"(x {n} samples / {updates} updates) but --qrl-prompts-per-step is "
                f"{values['qrl_prompts_per_step']}; drop one of them")
        out += ["--qrl-prompts-per-step", str(prompts)]
    return out, settings


def parse_configs(argv: Sequence[str]) -> tuple[QrlConfigs, dict[str, Any], argparse.Namespace]:
    """``(configs, effective flag values, namespace)`` of a ``qrl-train`` command line.

    The Megatron flags after ``--`` (:mod:`megatron_qrl.config.megatron_flags`) become
    ``--qrl-*`` values and ``configs.megatron`` (a ``MegatronSettings``). Raises
    :class:`QrlArgumentError` (one message naming the flags) on bad values.
    """
    argv = list(argv)
    megatron_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    argv, settings = _megatron_rewrites(argv, megatron_argv)
    args = build_parser().parse_args(_with_default_preset(argv))
    args.megatron_argv = megatron_argv
    configs = validate_qrl_args(args)
    flags = effective_values(args)
    configs.megatron = settings
    check_moe_flags(settings, configs.lora.enabled, configs.train.moe_experts)
    flags["megatron_layout"] = settings.describe()
    from megatron_qrl.rl.pipeline import pipeline_problem

    problem = pipeline_problem(configs, settings.pp)
    if problem:
        raise QrlArgumentError(problem)
    job: JobConfig = qrl_configs_from_args(args, [job_group()])["job"]
    configs.job = job
    args.world_size = _world_size(job, settings)
    job.check(configs, megatron_argv)
    return configs, flags, args


def main(argv: Sequence[str] | None = None, engine_factory: Any = None) -> int:
    """Entry point of the ``qrl-train`` console script.

    A user-fixable failure (bad flag or file, damaged checkpoint, full / read-only disk, a
    run stopped by ``--qrl-max-bad-steps``) is ONE line ``qrl-train: error: ...`` (exit 2; 1
    for a stopped run). So is a job that cannot go on: engines that cannot recover, a lost,
    frozen or missing peer (exit 1). Under torchrun EVERY rank prints its own line, prefixed
    ``[node N rank R]``, and leaves it for its peers (:mod:`megatron_qrl.utils.ranks`), whose
    lines name it. ``--debug`` or env ``QRL_DEBUG=1`` shows the traceback.
    SIGINT / SIGTERM stop the run after the current step with a checkpoint: one line, exit
    130 / 143 (:mod:`megatron_qrl.rl.stop`).
    """
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    argv = list(sys.argv[1:] if argv is None else argv)
    head = argv[: argv.index("--")] if "--" in argv else argv
    debug = debug_enabled("--debug" in head)
    try:
        configs, flags, args = parse_configs(argv)
        if args.world_size > 1:
            _require_torchrun(args.world_size)
    except QrlArgumentError as exc:
        build_parser().error(str(exc))
    from megatron_qrl.rl.stop import RunStopped

    board = _rank_board(args, configs)
    try:
        _run_main(args, configs, flags, argv, engine_factory, board)
    except RunStopped as exc:  # SIGINT / SIGTERM: stopped after a step, with a checkpoint
        if os.environ.get("RANK", "0") == "0":
            print(f"qrl-train: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:  # before the steps started or at a second Ctrl-C
        if debug:
            traceback.print_exc()
        print("qrl-train: interrupted (SIGINT) outside a step boundary; the last "
              "checkpoint is the one to resume from (--qrl-resume)", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - user errors become one line, bugs re-raise
        line, code = getattr(exc, "qrl_line", None) or error_line(exc, configs.run, board,
                                                                   configs.launch)
        if line is None:
            if board is not None:  # the peers that lose this rank say why
                board.record_failure(f"{type(exc).__name__}: {str(exc)[:300]}")
            raise
        if board is not None:
            board.record_failure(line)
        if debug:
            traceback.print_exc()
        where = rank_label()  # every rank prints its own line, prefixed with node / rank
        print(f"qrl-train: error: {f'[{where}] ' if where else ''}{line}", file=sys.stderr,
              flush=True)
        return code
    return 0


def _rank_board(args: argparse.Namespace, configs: QrlConfigs) -> Any:
    """This rank's :class:`~megatron_qrl.utils.ranks.RankBoard` under torchrun, else None."""
    if args.world_size <= 1:
        return None
    from megatron_qrl.utils.ranks import RankBoard

    return RankBoard(int(os.environ["RANK"]), args.world_size)


def _run_main(args: argparse.Namespace, configs: QrlConfigs, flags: dict, argv: list[str],
              engine_factory: Any, board: Any = None) -> None:
    from megatron_qrl.rl.driver import run_job
    from megatron_qrl.rl.sync import make_engine

    factory: list[Any] = [engine_factory or make_engine]
    progress = not args.qrl_no_progress
    world: list[Any] = [None]

    def run(cfg: dict, fl: dict, **kw: Any) -> list[dict]:
        return run_job(cfg, fl, engine_factory=factory[0], progress=progress, world=world[0],
                       **kw)

    if args.world_size > 1:
        _launch_ranks(args, configs, flags, run, world, factory, engine_factory, board)
    else:
        with _ray_session(configs.job.mode, configs, True) as session:
            if session is not None and engine_factory is None:
                factory[0] = session.engine_factory
            _launch(args, configs, flags, argv, run)


def _require_torchrun(world_size: int) -> None:
    """``WORLD_SIZE`` > 1 means torchrun launched this process: its other variables must be set."""
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise QrlArgumentError(
            f"WORLD_SIZE={world_size} is set in the environment but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: launch with torchrun --nproc-per-node "
            f"{world_size} (which sets them all), or unset WORLD_SIZE for one process")


_DAMAGED = ("SafetensorError", "CheckpointException", "UnpicklingError", "EOFError")
"""Exception types of an unreadable (damaged, truncated) weight file."""


def error_line(exc: BaseException, run: Any, board: Any = None,
               launch: Any = None) -> tuple[str | None, int]:
    """``(one-line message, exit code)`` of a user-fixable failure, of a job that cannot go
    on (an engine fleet that cannot recover, a lost or missing node: exit 1); ``(None, 1)``
    for a bug (its traceback is shown)."""
    from megatron_qrl.data.dataset import PromptFileError
    from megatron_qrl.models.hf_config import UnsupportedModelError
    from megatron_qrl.models.hf_io import (
        CheckpointMismatchError,
        CheckpointReadError,
        QuantizedCheckpointError,
    )
    from megatron_qrl.quant.uaq import AlreadyScaledError
    from megatron_qrl.rl.checkpoint import DriverCheckpointError
    from megatron_qrl.rl.forward import ForwardUnavailableError
    from megatron_qrl.rl.guard import BadStepsError
    from megatron_qrl.rl.sync import NonFiniteWeightsError

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (BadStepsError, NonFiniteWeightsError)):
        return first, 1
    job = _job_failure(exc, first, board, launch)
    if job is not None:
        return job, 1
    if isinstance(exc, (UnsupportedModelError, CheckpointMismatchError, CheckpointReadError,
                        QuantizedCheckpointError)):
        where = f"--qrl-checkpoint {run.checkpoint}: " if run.checkpoint else ""
        return where + first, 2
    if isinstance(exc, (FileExistsError, FileNotFoundError, NotImplementedError,
                        QrlArgumentError, ForwardUnavailableError, DriverCheckpointError,
                        PromptFileError, AlreadyScaledError)):
        return first, 2
    if ((isinstance(exc, OSError) or disk_error(exc) is not None)
            and (line := one_line_error(exc)) is not None):
        return line, 2  # a full / read-only disk: utils.cli's wording, as the tools say it
    if type(exc).__name__ in _DAMAGED and run.checkpoint:
        return (f"--qrl-checkpoint {run.checkpoint}: a weight file is damaged or truncated "
                f"({type(exc).__name__}: {first}); copy or convert the checkpoint again"), 2
    return None, 1


def _job_failure(exc: BaseException, first: str, board: Any, launch: Any) -> str | None:
    """The one line of a job that cannot go on (``error_line``), or None."""
    from megatron_qrl.rl.rank_resync import MainRankStopped
    from megatron_qrl.rl.ray_placement import PlacementError
    from megatron_qrl.rollout.supervisor import EngineDiedError
    from megatron_qrl.utils.ranks import StartupTimeoutError, peer_loss

    if isinstance(exc, (MainRankStopped, PlacementError, StartupTimeoutError)):
        return first
    if isinstance(exc, EngineDiedError):
        return f"the rollout engines cannot recover: {first[:500]}"
    if board is not None and isinstance(exc, RuntimeError):
        return peer_loss(exc, board, launch.collective_timeout_s if launch else 0.0)
    return None


def _world_size(job: JobConfig, mega: Any) -> int:
    """The torchrun world size, checked against the Megatron layout and the job."""
    from megatron_qrl.models.runtime import torchrun_world_size

    try:
        world_size = torchrun_world_size()
    except ValueError as exc:
        raise QrlArgumentError(str(exc)) from None
    job.check_world(world_size, mega)
    mega.check_world(world_size)
    return world_size


@contextlib.contextmanager
def _ray_session(mode: str, configs: QrlConfigs, is_main: bool) -> Iterator[Any]:
    """The :class:`~megatron_qrl.rl.ray_modes.RaySession` of a Ray mode on the rank that
    owns the engine (rank 0); None in single mode and on the other ranks (never touch Ray)."""
    if mode == "single" or not is_main:
        yield None
        return
    from megatron_qrl.rl.ray_modes import RaySession, engine_gpus

    run = configs.run
    ro = configs.rollout
    launch = configs.launch
    waits = {"pg_timeout_s": launch.startup_timeout_s, "ray_nodes": launch.ray_nodes}
    if ro.num_engines > 1 or ro.engine_tp > 1 or ro.engine_ep > 1:  # a fleet (rl.ray_fleet)
        from megatron_qrl.rl.ray_fleet import FleetSession

        with FleetSession(mode, configs.rollout, max_restarts=run.engine_max_restarts,
                          weight_transport=run.ray_weight_transport,
                          weight_timeout_s=run.ray_weight_timeout_s, **waits) as session:
            yield session
        return
    with RaySession(mode, engine_gpus=engine_gpus(configs.rollout),
                    max_restarts=run.engine_max_restarts,
                    weight_transport=run.ray_weight_transport,
                    weight_timeout_s=run.ray_weight_timeout_s, **waits) as session:
        yield session


def _launch_ranks(args: argparse.Namespace, configs: QrlConfigs, flags: dict, run: Any,
                  world: list[Any], factory: list[Any], engine_factory: Any,
                  board: Any) -> None:
    from megatron_qrl.models.runtime import torchrun_megatron

    mega, launch = configs.megatron, configs.launch
    label = rank_label()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts it
        board.wait_for_ranks(launch.startup_timeout_s,
                             lambda m: print(f"[qrl-train] [{label}] {m}", file=sys.stderr,
                                             flush=True))
    with torchrun_megatron(mega.tp, mega.ep, mega.etp, mega.pp,
                           timeout_s=launch.collective_timeout_s) as rank_world:
        world[0] = rank_world
        try:
            with _ray_session(configs.job.mode, configs, rank_world.is_main) as session:
                if session is not None and engine_factory is None:
                    factory[0] = session.engine_factory
                records = run(configs, flags)
        except Exception as exc:  # the line for the peers, while this rank's group still stands
            exc.qrl_line = error_line(exc, configs.run, board, launch)  # type: ignore[attr-defined]
            line = exc.qrl_line[0] or f"{type(exc).__name__}: {str(exc)[:300]}"
            board.record_failure(line)
            raise
        if rank_world.is_main:
            _summary(records)


def _launch(args: argparse.Namespace, configs: QrlConfigs, flags: dict, argv: list[str],
            run: Any) -> None:
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        job = configs.job
        if job.compare:
            from megatron_qrl.rl.compare import run_compare, variants_for_mode
            from megatron_qrl.rl.compare_sets import VARIANT_SETS

            base = _compare_base(argv)

            def parse(v: list[str]) -> tuple[dict, dict]:
                return parse_configs(v)[:2]

            out = configs.run.output_dir or configs.run.resolved_output_dir() + "-compare"
            run_compare(base, parse, run, out, seeds=job.seed_list,
                        variants=variants_for_mode(job.mode, VARIANT_SETS[job.compare].variants),
                        after=VARIANT_SETS[job.compare].after)
        else:
            records = run(configs, flags)
            _summary(records)


def _compare_base(argv: Sequence[str]) -> list[str]:
    """The command line of the compare's runs: without the launcher's compare flags."""
    out, skip, skip_set = [], False, False
    for a in _with_default_preset(argv):
        if skip:
            skip = False
        elif a == "--qrl-seeds":
            skip = True
        elif a == "--qrl-compare":
            skip_set = True
            continue
        elif skip_set and a in COMPARE_SETS:
            pass
        elif not a.startswith(("--qrl-seeds=", "--qrl-compare=")):
            out.append(a)
        skip_set = False
    return out


def _summary(records: Sequence[dict]) -> None:
    """The RL phase's accuracy in windows of 10 steps and its fitted slope (utils.curves),
    over the whole run (``run_job`` returns a resumed run's earlier records too)."""
    from megatron_qrl.utils.curves import summary_line

    acc = [r["accuracy"] for r in records if r["phase"] == "rl" and r.get("accuracy") is not None]
    if len(acc) >= 2:
        print(f"[qrl-train] {summary_line(acc)}")

if __name__ == "__main__":
    sys.exit(main())
