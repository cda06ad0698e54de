"""How ``qrl-train`` runs the job (``--qrl-mode``, ``--qrl-compare``, ``--qrl-seeds``).

:class:`JobConfig` is the launcher's own config group: its flags are generated like every
other ``--qrl-*`` flag (:func:`job_group`, added by ``rl.cli.build_parser`` to its launcher
group) but they are not part of :func:`~megatron_qrl.config.add_qrl_args` (Megatron's
``extra_args_provider`` and the slime integration run no compare and place no engine) nor of
the run's stored flags. The rules that combine them with the other groups live here:
:meth:`JobConfig.check` (the built configs and the Megatron flags after ``--``) and
:meth:`JobConfig.check_world` (the torchrun world).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .args import QrlArgumentError
from .generator import ConfigGroup
from .run import _choice

__all__ = ["COMPARE_SETS", "MODES", "JobConfig", "job_group", "parse_seeds"]

MODES = ("single", "colocated", "disaggregated")
"""``--qrl-mode`` values: the engine in this process, or in a Ray actor (``rl.ray_modes``)."""
COMPARE_SETS = ("papers", "rlquant")
"""``--qrl-compare`` variant sets (the keys of :data:`megatron_qrl.rl.compare_sets.VARIANT_SETS`)."""


def parse_seeds(text: str | None) -> list[int | None]:
    """``--qrl-seeds 1,2,3`` -> ``[1, 2, 3]`` (distinct non-negative integers); None / '' ->
    ``[None]`` (one run at ``--qrl-seed``)."""
    if not text:
        return [None]
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise QrlArgumentError(f"--qrl-seeds {text!r}: give comma-separated integers, e.g. "
                               "--qrl-seeds 1,2,3") from None
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise QrlArgumentError(f"--qrl-seeds {text!r}: seeds must be distinct and >= 0")
    return list(seeds)


@dataclass(frozen=True)
class JobConfig:
    """Where the rollout engine runs, and the compare study (module docstring)."""

    compare: Literal["papers", "rlquant"] | None = field(default=None,
                                                         metadata={"const": "papers"})
    """run the same RL budget for every variant of a set in megatron_qrl.rl.compare and write
    compare.md / compare.png in the output directory. papers (the default): bf16, w4a16 naive
    / tis / acr / aligned+tbpo / tis+aqn, int8 low-lr with and without UAQ, LoRA; rlquant:
    full-precision RL then PTQ (RTN, AWQ, SmoothQuant) vs QAFT vs QLoRA, each evaluated at its
    deployed format"""

    seeds: str | None = field(default=None, metadata={"metavar": "S1,S2,..."})
    """with --qrl-compare: run every variant on each of these seeds (one warm-up per seed);
    the table gives mean +- std over them"""

    mode: Literal["single", "colocated", "disaggregated"] = "single"
    """single: the rollout engine in this process (rank 0 under torchrun). colocated /
    disaggregated: the rollout engine in a Ray actor (same / own placement-group bundle; joins
    RAY_ADDRESS or a `ray start` cluster, else starts a local one); the trainer stays in this
    process or torchrun's ranks (rank 0 talks to Ray)"""

    def __post_init__(self) -> None:
        _choice("--qrl-mode", self.mode, MODES)
        if self.compare is not None:
            _choice("--qrl-compare", self.compare, COMPARE_SETS)
        if self.seeds is not None and not self.compare:
            raise QrlArgumentError("--qrl-seeds is for --qrl-compare; for one run use --qrl-seed")
        if self.compare:
            parse_seeds(self.seeds)

    @property
    def ray(self) -> bool:
        """The engine runs in a Ray actor (``--qrl-mode colocated|disaggregated``)."""
        return self.mode != "single"

    @property
    def seed_list(self) -> list[int | None]:
        """The compare's seeds (:func:`parse_seeds`)."""
        return parse_seeds(self.seeds)

    def check(self, configs: Mapping[str, Any], megatron_argv: Sequence[str] = ()) -> None:
        """The rules between the job and the other groups (``configs``: the built configs of
        :func:`~megatron_qrl.config.validate_qrl_args`; ``megatron_argv``: the Megatron flags
        after ``--``); the first broken one is a :class:`QrlArgumentError` naming the flags."""
        problem = self.problem(configs, megatron_argv)
        if problem:
            raise QrlArgumentError(problem)

    def problem(self, configs: Mapping[str, Any], megatron_argv: Sequence[str] = ()
                ) -> str | None:
        """The first rule of :meth:`check` that ``configs`` break, or None."""
        run, ro, lora = configs["run"], configs["rollout"], configs["lora"]
        mode = self.mode
        if self.ray and ro.sglang.base_gpu:
            return (f"--qrl-rollout-sglang-base-gpu places the in-process engine of --qrl-mode "
                    f"single; in --qrl-mode {mode} Ray gives the engine actor its GPU: drop the "
                    "flag")
        if self.ray and ro.sglang.sync == "distributed":
            return (f"--qrl-rollout-sglang-sync distributed is for --qrl-mode single (engine on "
                    f"other GPUs of this process's node); in --qrl-mode {mode} the weights reach "
                    "the engine actor by --qrl-ray-weight-transport broadcast, and the actor "
                    "loads them on its own GPU: use --qrl-rollout-sglang-sync auto")
        if ro.sglang.sync == "direct":
            text = _direct_problem(mode, megatron_argv)
            if text:
                return text
        if run.trainer_sleep == "on" and mode == "disaggregated":
            return ("--qrl-trainer-sleep on with --qrl-mode disaggregated: the engine has GPUs "
                    "of its own, the trainer's sleep frees nothing it can use; drop the flag (or "
                    "use --qrl-mode colocated)")
        if (run.trainer_sleep == "on" and not self.ray and ro.engine == "sglang"
                and not ro.sglang.release_memory):
            return ("--qrl-trainer-sleep on with --no-qrl-rollout-sglang-release-memory: the "
                    "engine would keep its memory through training while the trainer wakes "
                    "beside it; drop --no-qrl-rollout-sglang-release-memory (or the sleep)")
        if run.steps == 0 and (run.sft_steps == 0 or self.compare):
            return (f"--qrl-steps 0{'' if self.compare else ' with --qrl-sft-steps 0'}: nothing "
                    "to run; give --qrl-steps N (or --train-iters N after '--')")
        if not self.ray and (ro.num_engines > 1 or ro.engine_tp > 1 or ro.engine_ep > 1):
            return (f"--qrl-rollout-num-engines {ro.num_engines} / --qrl-rollout-engine-tp "
                    f"{ro.engine_tp} / --qrl-rollout-engine-ep {ro.engine_ep}: the fleet runs its "
                    "engines as Ray actors: add --qrl-mode colocated (engines on the trainer's "
                    "GPUs) or disaggregated (GPUs of their own)")
        if self.ray and lora.enabled:
            return (f"--qrl-lora-rank {lora.rank} with --qrl-mode {mode}: the Ray engine actor "
                    "does not serve LoRA adapters yet (its engine interface has no adapter load "
                    "/ unload and its re-sync sends full weights); use --qrl-mode single")
        if self.compare and run.resume:
            return ("--qrl-compare cannot be combined with --qrl-resume (each variant starts "
                    "from the shared warm-up); drop one of them")
        if self.compare and megatron_argv:
            return ("--qrl-compare runs its variants in one process; drop the Megatron flags "
                    "after '--' (or run the variants one by one)")
        return None

    def check_world(self, world_size: int, megatron: Any) -> None:
        """The torchrun world (``world_size``) against the job and the Megatron layout
        (``megatron``: a :class:`~megatron_qrl.config.megatron_flags.MegatronSettings`)."""
        if world_size == 1 and megatron.model_parallel_size > 1 and self.ray:
            n = megatron.model_parallel_size
            raise QrlArgumentError(
                f"--qrl-mode {self.mode} with the Megatron layout ({megatron.describe()}) needs "
                f"{n} trainer ranks: launch with torchrun --nproc-per-node {n} -m "
                f"megatron_qrl.rl.cli --qrl-mode {self.mode} ... (rank 0 drives the Ray "
                "engine actor)")
        if world_size > 1 and self.compare:
            raise QrlArgumentError("--qrl-compare runs in one process; launch it without "
                                   "torchrun")


def _direct_problem(mode: str, megatron_argv: Sequence[str]) -> str | None:
    """Where ``--qrl-rollout-sglang-sync direct`` does not apply: it writes whole tensors from
    one trainer process into the in-process engine on the same GPU."""
    if mode != "single":
        return (f"--qrl-rollout-sglang-sync direct writes into the in-process engine of "
                f"--qrl-mode single; in --qrl-mode {mode} the weights reach the engine actor by "
                "--qrl-ray-weight-transport: use --qrl-rollout-sglang-sync auto")
    if megatron_argv:
        from .megatron_flags import parse_megatron_flags

        mega = parse_megatron_flags(megatron_argv)[0]
        if mega.model_parallel_size > 1:
            return (f"--qrl-rollout-sglang-sync direct needs one unsharded trainer (tensor, "
                    f"expert and pipeline parallel 1), this run has {mega.describe()}: use "
                    "--qrl-rollout-sglang-sync inplace")
    return None


def job_group() -> ConfigGroup:
    """The ``--qrl-mode`` / ``--qrl-compare`` / ``--qrl-seeds`` flags' config group (key
    ``job``, no prefix)."""
    return ConfigGroup("job", JobConfig, "")
