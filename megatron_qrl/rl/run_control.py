"""What keeps one run whole: its paths, its save schedule, its stop line, the metrics a resume
needs, and the lines that say what the run does.

- :func:`check_run_paths`: ``--qrl-output-dir`` (and ``--qrl-tensorboard-dir``) never equal
  to, inside, or around an input of the run (``--qrl-checkpoint``, ``--qrl-task-prompts``);
  symlinks resolved; one line naming both flags.
- :func:`save_due`: ``--qrl-save-interval N`` saves every N steps of each phase (SFT steps
  counted from the first SFT step, RL steps from the first RL step), at the end of SFT and
  at the end of the run.
- :func:`check_resume_metrics`: a resume from the checkpoint of step ``k`` needs the records
  of steps ``0 .. k-1`` in metrics.jsonl (a torn last line is dropped with a warning by
  :func:`~megatron_qrl.utils.metrics.read_metrics`); fewer are refused unless
  ``--qrl-resume-allow-missing-metrics``.
- :func:`describe_run`: the LoRA setup (rank, targets, base format, trainable parameters)
  and how the rollout engine serves a step's requests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.config.configs import QrlConfigs
from megatron_qrl.utils.metrics import METRICS_FILE, read_metrics
from megatron_qrl.utils.outdir import path_overlap

__all__ = ["check_resume_metrics", "check_run_paths", "describe_run", "save_due", "stop_line",
           "update_ratio"]


def check_run_paths(configs: QrlConfigs) -> None:
    """Raise :class:`QrlArgumentError` when an output directory of the run overlaps an
    input (module docstring)."""
    run, task = configs.run, configs.task
    outputs = [("--qrl-output-dir", run.resolved_output_dir())]
    if run.tensorboard_dir:
        outputs.append(("--qrl-tensorboard-dir", run.tensorboard_dir))
    inputs = [(f, p) for f, p in (("--qrl-checkpoint", run.checkpoint),
                                  ("--qrl-task-prompts", task.prompts)) if p]
    for oflag, out in outputs:
        for iflag, inp in inputs:
            how = path_overlap(Path(out).resolve(), Path(inp).resolve())
            if how is not None:
                raise QrlArgumentError(
                    f"{oflag} {out} {how} the input {iflag} {inp}: the run would write into "
                    f"its own input (and a later rewrite of the input would delete the run); "
                    f"choose an {oflag} apart from it")


def save_due(interval: int, done: int, sft_steps: int, total: int) -> bool:
    """Whether a checkpoint is written after ``done`` steps (module docstring)."""
    if interval < 0:
        return False
    if done in (sft_steps, total):
        return True
    if not interval:
        return False
    return done % interval == 0 if done < sft_steps else (done - sft_steps) % interval == 0


def update_ratio(configs: QrlConfigs, log: Callable[[str], None]) -> float:
    """``--qrl-max-update-ratio``, or 0 (no parameter check) where the optimizer's state
    lives in megatron's CPU-offloaded copy, which the guard's pre-step copy cannot restore."""
    ratio = configs.run.max_update_ratio
    mega = configs.megatron
    if ratio and mega is not None and mega.optimizer_cpu_offload:
        log("[qrl-train] --qrl-max-update-ratio: parameters are not checked after a step with "
            "--optimizer-cpu-offload (the offloaded optimizer state cannot be restored); NaN / "
            "inf losses and gradients still skip the update")
        return 0.0
    return ratio


def stop_line(signum: int, phase: str, step: int, path: Path | None) -> str:
    """The one line of a run stopped by a signal after ``step``."""
    from megatron_qrl.rl.stop import StopRequest

    where = (f"checkpoint at {path}; resume with --qrl-resume" if path is not None else
             "no checkpoint (--qrl-save-interval -1)")
    return f"stopped by {StopRequest.name(signum)} at {phase.upper()} step {step}; {where}"


def check_resume_metrics(out: Path, start: int, run: Any, log: Callable[[str], None]) -> None:
    """Refuse a resume from step ``start`` whose metrics.jsonl lacks earlier steps."""
    path = out / METRICS_FILE
    steps = {r.get("step") for r in read_metrics(path, warn=log)} if path.is_file() else set()
    missing = sorted(set(range(start)) - steps)
    if not missing:
        return
    what = (f"{path} does not exist" if not path.is_file() else
            f"{path} lacks {len(missing)} of the {start} steps before the checkpoint "
            f"(first missing: step {missing[0]})")
    if run.resume_allow_missing_metrics:
        log(f"[qrl-train] --qrl-resume: {what}; going on (--qrl-resume-allow-missing-metrics): "
            "the run's curves and summary lack those steps")
        return
    raise QrlArgumentError(
        f"--qrl-resume: {what}, the checkpoint is at step {start}; restore the file, or add "
        "--qrl-resume-allow-missing-metrics to go on without those records")


def _count(module: Any) -> tuple[int, int]:
    """(adapter parameters, all parameters) of ``module`` (this rank's shards)."""
    total = adapters = 0
    for name, p in module.named_parameters():
        total += p.numel()
        if ".lora_A." in name or ".lora_B." in name:
            adapters += p.numel()
    return adapters, total


def describe_run(ctx: Any, configs: QrlConfigs, log: Callable[[str], None]) -> None:
    """Log the LoRA setup, how the weight sync quantizes, how the engine serves a step's
    requests and, where the engine reports them, its attention backend and how many requests
    it decodes at once (rank 0's ``log``)."""
    lora = configs.lora
    if lora.enabled:
        adapters, total = _count(ctx.trainer.module)
        share = 100.0 * adapters / total if total else 0.0
        log(f"[qrl-train] LoRA: rank {lora.rank}, alpha {lora.scaling * lora.rank:g}, targets "
            f"{','.join(lora.targets)}{' + routed experts' if lora.experts else ''}, base "
            f"format {lora.base_format}; trainable in RL: {adapters:,} of {total:,} "
            f"parameters ({share:.3g}%) (SFT trains every parameter)")
    if ctx.engine is None:
        return
    if ctx.sync_quantization:
        log(f"[qrl-train] weight sync quantization: {ctx.sync_quantization}")
    run, ro = configs.run, configs.rollout
    requests = run.prompts_per_step * ro.n_samples_per_prompt
    members = getattr(ctx.engine, "members", None)
    if members:
        how = (f"{len(members)} {ro.engine} engines, each generating one prompt group "
               f"({ro.n_samples_per_prompt} requests) per call: up to "
               f"{len(members) * ro.n_samples_per_prompt} requests at once")
    else:
        how = (f"one {ro.engine} engine, " + ("one prompt group per call (seeded per group)"
                                              if ro.engine == "reference" else
                                              f"all {requests} requests of a step in one call"))
    log(f"[qrl-train] rollout: {requests} requests per step ({run.prompts_per_step} prompts x "
        f"{ro.n_samples_per_prompt} samples); {how}")
    attention = getattr(ctx.engine, "attention", None)  # an in-process SGLang engine's choice
    if attention is not None:
        log(f"[qrl-train] {attention.describe()}")
        log(f"[qrl-train] {ctx.engine.options.describe_sync()}")
    capacity = ctx.engine.capacity()
    if capacity is not None:  # the longest prompt of the task plus every new token
        longest = max((len(ctx.prompt_ids(r)) for r in ctx.records), default=0)
        log(f"[qrl-train] {capacity.describe(requests, longest + ro.max_new_tokens)}")
