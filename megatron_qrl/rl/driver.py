"""The single-process RL driver (no Ray): SFT warm-up, then RL steps, metrics, checkpoints.

Call :func:`run_job` inside an initialised megatron job (``qrl-train`` does it with
:func:`megatron_qrl.models.runtime.single_process_megatron`). Step numbering is global:
SFT steps ``0 .. sft_steps-1``, RL steps ``sft_steps .. sft_steps+steps-1``. The engine holds
weight version ``k`` when RL step ``k`` starts. ``--qrl-model checkpoint`` starts from
``--qrl-checkpoint DIR`` and its tokenizer (:mod:`megatron_qrl.rl.start_model`).

Multi-rank (``torchrun``, :func:`megatron_qrl.models.runtime.torchrun_megatron`, a
:class:`~megatron_qrl.models.runtime.RankWorld` passed as ``world``): every rank builds its
TP / EP shard of the policy and trains; rank 0 alone owns the rollout engine, the progress
bar, metrics.jsonl, plots and checkpoints. Rollouts are broadcast from rank 0 so every rank
holds the same batch (data-parallel ranks split each optimizer step's micro batches); a weight
sync gathers the full HF tensors to rank 0 (``iter_hf_tensors``), except where trainer EP > 1
feeds a fleet of reference engines: there every EP rank sends its own experts
(:mod:`megatron_qrl.rl.ep_sync`, whose ``sharded_sync_applies`` is the one rule). With a Ray engine actor
(``--qrl-mode colocated|disaggregated``) rank 0 alone talks to Ray, and an actor restart's
re-sync runs on every rank (:mod:`megatron_qrl.rl.rank_resync`).
A checkpoint holds every rank's model / optimizer state in one atomically written file.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_qrl.config import QrlArgumentError, prox_first_blocker
from megatron_qrl.config.configs import QrlConfigs
from megatron_qrl.config.megatron_flags import MegatronSettings, check_shape
from megatron_qrl.config.moe_path import moe_overrides
from megatron_qrl.data import CharTokenizer, addition_problems, tiny_dense_config, tiny_moe_config
from megatron_qrl.data.dataset import PromptRecord, load_prompt_jsonl
from megatron_qrl.models.builder import resolve_transformer_impl
from megatron_qrl.models.hf_config import ModelArch, arch_from_dict
from megatron_qrl.models.runtime import RankWorld
from megatron_qrl.rl.checkpoint import (
    load_driver_checkpoint,
    prepare_output_dir,
    save_driver_checkpoint,
)
from megatron_qrl.rl.ep_sync import ShardedSync, sharded_sync_applies
from megatron_qrl.rl.forward import forward_plan
from megatron_qrl.rl.guard import BadStepGuard
from megatron_qrl.rl.lora_sync import LoraSync, enter_lora
from megatron_qrl.rl.qcache_sync import QCacheSync
from megatron_qrl.rl.rank_resync import ResyncWorld
from megatron_qrl.rl.run_control import (
    check_resume_metrics,
    check_run_paths,
    describe_run,
    save_due,
    stop_line,
    update_ratio,
)
from megatron_qrl.rl.start_model import (
    HFTokenizer,
    StartCheckpoint,
    check_uaq_once,
    load_start_weights,
    load_tokenizer,
    read_start_checkpoint,
)
from megatron_qrl.rl.steps import StepContext, make_loss_fn, rl_step, sft_step
from megatron_qrl.rl.stop import RunStopped, StopRequest
from megatron_qrl.rl.sync import make_engine, refuse_non_finite
from megatron_qrl.rl.sync_plan import SyncPlan
from megatron_qrl.rl.trainer import PolicyTrainer, TrainerOptions, build_policy
from megatron_qrl.rl.trainer_sleep import TrainerSleep, sleep_line, trainer_sleep_on
from megatron_qrl.utils.metrics import MetricsLogger
from megatron_qrl.utils.run_lock import acquire_run_lock

__all__ = ["JobData", "prepare_job", "run_job"]

EngineFactory = Callable[[Any, dict, int], Any]


@dataclass
class JobData:
    """Tokenizer, prompts and model shape of a job."""

    tokenizer: CharTokenizer | HFTokenizer
    records: list[PromptRecord]
    hf_config: dict
    arch: ModelArch
    start: StartCheckpoint | None = None
    """``--qrl-model checkpoint``: the weights to start from (None: random init)."""


def _checkpoint_job(configs: QrlConfigs) -> tuple[CharTokenizer | HFTokenizer, StartCheckpoint]:
    start = read_start_checkpoint(configs.run.checkpoint)
    check_uaq_once(start, configs.uaq.enabled)
    tok = load_tokenizer(start.path)
    if tok.vocab_size > start.arch.vocab_size:
        raise ValueError(f"--qrl-checkpoint {start.path}: the tokenizer has {tok.vocab_size} "
                         f"tokens, the model's vocab_size is {start.arch.vocab_size}; the "
                         "tokenizer does not belong to this model")
    return tok, start


def prepare_job(configs: QrlConfigs) -> JobData:
    """The task's records, tokenizer and model named by ``--qrl-model`` (no weights read).

    The Megatron shape flags after ``--`` (``configs.megatron``) override the tiny model's
    shape and must agree with a checkpoint's.
    """
    run, task = configs.run, configs.task
    mega = configs.megatron or MegatronSettings()
    if task.prompts:
        records = load_prompt_jsonl(task.prompts)
    else:
        records = [PromptRecord(p["prompt"], p["answer"]) for p in addition_problems(
            task.num_prompts, run.seed, task.digits_min, task.digits_max)]
    if run.model == "checkpoint":
        tok, start = _checkpoint_job(configs)
        mega.apply_to_hf_config(start.hf_config, start.arch, f"--qrl-checkpoint {start.path}",
                                fixed_model=True)
        return _checked(JobData(tok, records, start.hf_config, start.arch, start), mega)
    char = CharTokenizer()
    source = f"--qrl-model {run.model}"
    cfg = (tiny_moe_config if run.model == "tiny-moe" else tiny_dense_config)(char.vocab_size)
    cfg = mega.apply_to_hf_config(cfg, arch_from_dict(cfg, source=source), source,
                                  fixed_model=False)
    return _checked(JobData(char, records, cfg, check_shape(mega, cfg, source)), mega)


def _checked(data: JobData, mega: MegatronSettings) -> JobData:
    """Raise naming the Megatron flag when the layout cannot hold ``data.arch``."""
    try:
        mega.layout().check(data.arch)
    except ValueError as exc:
        hint = (" (the tiny models have 1 KV head: add --group-query-attention "
                "--num-query-groups 2 after '--' to give them 2)"
                if "num_key_value_heads" in str(exc) else "")
        pp = f"--pipeline-model-parallel-size {mega.pp} / " if mega.pp > 1 else ""
        raise QrlArgumentError(f"--tensor-model-parallel-size {mega.tp} / {pp}"
                               f"--expert-model-parallel-size {mega.ep}: {exc}{hint}") from None
    if data.arch.is_moe and mega.tp > 1 and not mega.sequence_parallel:
        raise QrlArgumentError(f"--tensor-model-parallel-size {mega.tp} on a MoE model needs "
                               "--sequence-parallel (megatron-core trains MoE with TP > 1 only "
                               "with sequence parallelism); add it after '--'")
    return data


def _apply_uaq(trainer: PolicyTrainer, data: JobData, scale: float) -> None:
    from megatron_qrl.models.streaming import load_hf_weights
    from megatron_qrl.quant.uaq import apply_uaq

    scaled = apply_uaq(dict(trainer.hf_tensors()), data.hf_config, scale)
    load_hf_weights(trainer.module, data.arch, scaled.__getitem__, trainer.policy.groups)


def _seed_megatron(seed: int) -> None:
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _start_rl(ctx: StepContext, data: JobData, step: int, resumed: bool) -> None:
    """Enter the RL phase: fresh Adam at the RL lr, UAQ once, first weight sync."""
    configs = ctx.configs
    policy = ctx.trainer.policy
    if not resumed:
        enter_lora(ctx.trainer, configs)  # LoRA: freeze (and quantize) the base, adapters on
        policy.set_optimizer(policy.new_optimizer(configs.run.lr))
        if configs.uaq.enabled:
            _apply_uaq(ctx.trainer, data, configs.uaq.scale)
            policy.plan.weights_changed()
    ctx.before_sync()  # a sleeping trainer: its optimizer state off the GPU, the engine back
    ctx.sync(step)


def _postfix(rec: dict[str, Any]) -> dict[str, str]:
    if rec["phase"] == "sft":
        return {"sft_loss": f"{rec.get('sft_loss') or 0:.3f}"}

    def f(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3g}"

    route = {} if rec.get("routing_agreement") is None else {
        "route": f(rec["routing_agreement"])}
    return {"reward": f(rec["reward_mean"]), "kl": f(rec["mismatch_kl"]),
            "clip": f(rec["clip_frac"]), "err": f(rec["error_token_rate"]), **route,
            "t(ro/rc/tr/sy)": "/".join(f"{rec[k]:.2f}" for k in (
                "time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s"))}


def _build(configs: QrlConfigs, data: JobData, engine_factory: EngineFactory,
           start_weights: dict | None, world: RankWorld) -> StepContext:
    run = configs.run
    mega = configs.megatron or MegatronSettings()
    plan = forward_plan(configs, data.arch)
    overrides, note = moe_overrides(
        mega, configs.train.moe_fast_path, data.arch.is_moe, lora=plan.lora is not None,
        te_spec=resolve_transformer_impl(mega.transformer_impl),
        stacked=configs.train.moe_experts == "stacked")
    plan.config_overrides.update(overrides)
    if note and world.is_main:
        print(f"qrl-train: {note}", file=sys.stderr, flush=True)
    _seed_megatron(run.seed)
    layout = mega.layout() if world.world_size > 1 else None
    groups = world.shard_groups(data.arch.num_layers)
    trainer = PolicyTrainer(build_policy(
        data.arch, run.sft_lr, plan, layout=layout, groups=groups, bf16=mega.bf16,
        options=TrainerOptions.from_flags(
            mega, per_token_loss=run.max_tokens_per_micro_batch > 0,
            pack_sequences=run.pack_sequences)))
    if data.start is not None:
        load_start_weights(trainer.module, data.start)
        plan.weights_changed()
    if start_weights is not None:
        trainer.module.load_state_dict(start_weights, strict=False)
        plan.weights_changed()
    serving = _lora_serving(configs, data.arch) if plan.lora is not None else None
    lora_kw = ({"lora": {"lora_rank": configs.lora.rank, "lora_serving": serving}}
               if serving is not None and serving.engine == "sglang" else {})
    sleeper = TrainerSleep.of_policy(trainer.policy) if trainer_sleep_on(configs) else None
    engine = _start_engine(configs, data, engine_factory, lora_kw, world, sleeper)
    if sleeper is not None:  # the RL step wakes the optimizer state behind the weights
        trainer.before_step.append(sleeper.state_ready)
    spec, aqn = configs.rollout.spec, configs.aqn
    # a Ray engine under torchrun: its restarts re-sync through every rank (rank_resync)
    ray_ranks = world.world_size > 1 and world.broadcast(hasattr(engine, "bind_resync"))

    lora = LoraSync(configs.lora, serving) if plan.lora is not None else None
    # trainer EP > 1 with a fleet of reference engines: every EP rank sends its own experts
    sharded = world.world_size > 1 and world.broadcast(
        sharded_sync_applies(engine, trainer.policy.groups, plan.lora is not None))
    qcache = QCacheSync.plan(plan.aligned, spec, trainer.policy.groups)
    syncs = SyncPlan(trainer, engine, spec, aqn, run.seed, run.sft_steps, run.steps, lora,
                     plan.lora, ShardedSync(trainer, spec, aqn, run.seed) if sharded else None,
                     qcache)
    gather, send = syncs.serve, syncs.send

    if ray_ranks:
        world = ResyncWorld.of(world, serve=gather)

    def first_bad(name: str | None) -> str | None:  # every rank's check, one answer
        return world.broadcast(next((b for b in world.gather(name) or [] if b), None))

    def sync(version: int) -> Any:
        refuse_non_finite(trainer.module.named_parameters(), version,
                          agree=first_bad if world.world_size > 1 else None)
        if not world.is_main:
            result = gather(version)
        elif not ray_ranks:
            result = send(version)
        else:
            try:
                result = send(version)
            except Exception as exc:  # the others wait for rank 0's message: stop them
                world.stop(exc)
                raise
        if ray_ranks:  # rank 0: the sync is over; the others serve its re-syncs until then
            world.broadcast(None)
        return result

    def resync(version: int) -> Any:  # rank 0, after an engine actor restart
        syncs.engine_restarted()
        if ray_ranks:
            world.announce_resync()
        return send(version)

    if hasattr(engine, "bind_resync"):  # Ray modes: a restarted engine actor re-syncs
        engine.bind_resync(resync)
    # single mode: the in-process engine shares the trainer's GPU (Ray colocated: the actor)
    release = bool(configs.rollout.sglang.release_memory
                   and configs.rollout.engine == "sglang" and not hasattr(engine, "bind_resync"))
    return StepContext(configs, data.tokenizer, data.records, trainer, engine, plan,
                       make_loss_fn(configs), sync, world, mega.seq_length,
                       mega.tp if world.world_size > 1 and mega.sequence_parallel else 1,
                       release_engine_memory=release, sleeper=sleeper,
                       engine_released=sleeper is not None and release,
                       sync_quantization=qcache.describe())


def _start_engine(configs: QrlConfigs, data: JobData, engine_factory: EngineFactory,
                  lora_kw: dict, world: RankWorld, sleeper: TrainerSleep | None) -> Any:
    """Rank 0's engine (None elsewhere). A sleeping trainer sleeps while the engine starts,
    so that the engine sizes its memory pool with the trainer's memory free, and wakes once
    the engine has released its memory again (the first weight sync resumes it)."""
    if sleeper is not None:
        sleeper.sleep()
    engine = engine_factory(engine_rollout_config(configs.rollout, sleeper is not None),
                            data.hf_config, configs.run.seed, **lora_kw) \
        if world.is_main else None
    if sleeper is not None:
        if engine is not None:
            engine.release_memory()
        sleeper.wake()
    return engine


def engine_rollout_config(rollout: Any, trainer_sleeps: bool) -> Any:
    """``rollout`` as the engine is built from it: a trainer that sleeps during rollout
    (``rl.trainer_sleep``) moves its weights off the GPU, and memory PyTorch shared by CUDA IPC
    stays allocated until the importer lets go, so an SGLang engine that held the trainer's
    tensors across syncs (``SGLangOptions.hold_trainer_tensors``) would keep them on the GPU
    through the sleep: it opens them anew each sync instead (the run log's sync line says
    so)."""
    if not (trainer_sleeps and rollout.engine == "sglang" and rollout.sglang.hold_trainer_tensors):
        return rollout
    return dataclasses.replace(rollout, sglang=dataclasses.replace(rollout.sglang,
                                                                   hold_trainer_tensors=False))


def _lora_serving(configs: QrlConfigs, arch: ModelArch) -> Any:
    """Which of the run's adapters the engine serves and which are merged into its base."""
    from megatron_qrl.rollout.lora_serving import resolve_lora_serving
    from megatron_qrl.utils.devices import gpu_capability

    lora, rollout = configs.lora, configs.rollout
    cap = gpu_capability()
    return resolve_lora_serving(rollout.engine, rollout.format, lora.targets,
                                is_moe=arch.is_moe, experts=lora.experts, capability=cap)


def _save(ctx: StepContext, out: Path, done: int, flags: dict[str, Any],
          data: JobData) -> Path | None:
    """Rank 0 writes one checkpoint with every rank's trainer state (atomic, verified);
    its path on rank 0."""
    world = ctx.world
    ctx.wake_trainer()  # the optimizer state slept since the weight sync (rl.trainer_sleep)
    states = world.gather(ctx.trainer.state_dict())
    path = None
    if world.is_main:
        path = save_driver_checkpoint(out, done, states[0], flags,
                                      rank_states=states if world.world_size > 1 else None,
                                      model_config=data.hf_config)
    world.barrier()
    return path


def _on_main(world: RankWorld, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on rank 0; its result (or its error) on every rank."""
    if world.world_size == 1:
        return fn()
    try:
        result = fn() if world.is_main else None
    except (OSError, ValueError) as exc:
        result = exc
    result = world.broadcast(result)
    if isinstance(result, BaseException):
        raise result
    return result


def _resume(ctx: StepContext, out: Path, flags: dict[str, Any], data: JobData,
            log: Callable[[str], None]) -> tuple[int, dict, Any]:
    """``(next step, this rank's trainer state, torch RNG state)`` of the newest intact
    checkpoint (damaged newer ones are reported through ``log``)."""
    state = load_driver_checkpoint(out, flags, data.hf_config, report=log)
    trainer_state = state["trainer"]
    if ctx.world.world_size > 1:
        ranks = state.get("rank_states") or []
        if len(ranks) != ctx.world.world_size:
            raise QrlArgumentError(
                f"--qrl-resume: the checkpoint in {out} holds {len(ranks) or 1} rank state(s), "
                f"this job has {ctx.world.world_size} ranks; resume with the same torchrun "
                "--nproc-per-node and Megatron layout flags")
        trainer_state = ranks[ctx.world.rank]
    return state["next_step"], trainer_state, state["rng"]


def run_job(configs: QrlConfigs, flags: dict[str, Any], *,
            engine_factory: EngineFactory = make_engine, progress: bool = True,
            start_weights: dict | None = None, skip_sft: bool = False,
            log: Callable[[str], None] = print,
            world: RankWorld | None = None) -> list[dict[str, Any]]:
    """Run SFT (unless ``skip_sft``: e.g. ``start_weights`` are already warmed up) and RL.

    ``flags``: the effective ``--qrl-*`` values (stored in checkpoints, checked on resume).
    ``world``: this rank of a torchrun job (None: one process). Returns the metrics records
    of the whole run on rank 0 (a resumed run's earlier steps included, as in
    ``<output-dir>/metrics.jsonl``), this invocation's on the other ranks (nothing written).
    The output directory is locked for the run (:mod:`megatron_qrl.utils.run_lock`); SIGINT /
    SIGTERM stop it after the current step with a checkpoint (:mod:`megatron_qrl.rl.stop`).
    """
    world = world or RankWorld()
    log = log if world.is_main else (lambda _msg: None)
    out = Path(configs.run.resolved_output_dir())
    log(f"[qrl-train] output directory: {out}")
    _on_main(world, lambda: check_run_paths(configs))
    lock = _on_main(world, lambda: acquire_run_lock(out, log=log))
    try:
        return _run_locked(configs, flags, engine_factory, progress, start_weights, skip_sft,
                           log, world, out)
    finally:
        if world.is_main:
            lock.release()


def _run_locked(configs: QrlConfigs, flags: dict[str, Any], engine_factory: EngineFactory,
                progress: bool, start_weights: dict | None, skip_sft: bool,
                log: Callable[[str], None], world: RankWorld, out: Path) -> list[dict[str, Any]]:
    from tqdm import tqdm

    run, main = configs.run, world.is_main
    has_checkpoint = _on_main(world, lambda: prepare_output_dir(out, run.resume))
    if run.resume and not has_checkpoint:
        log(f"[qrl-train] --qrl-resume: no checkpoint in {out} yet; starting the run at step 0")
    data = prepare_job(configs)
    why = prox_first_blocker(configs)
    if run.prox_from_first_update is None and why is not None and run.steps:
        log(f"[qrl-train] pi_prox: a recompute pass on every mini batch "
            f"(--qrl-prox-from-first-update unset: {why})")
    ctx = _build(configs, data, engine_factory, start_weights, world)
    describe_run(ctx, configs, log)
    log(sleep_line(ctx.sleeper is not None, configs))
    guard = ctx.trainer.guard = BadStepGuard(run.max_bad_steps, log, update_ratio(configs, log))
    sft_steps = 0 if skip_sft else run.sft_steps
    start, resumed = 0, False
    if has_checkpoint:
        start, trainer_state, rng = _resume(ctx, out, flags, data, log)
        _on_main(world, lambda: check_resume_metrics(out, start, run, log))
        if start > sft_steps:
            enter_lora(ctx.trainer, configs)
            ctx.trainer.policy.set_optimizer(ctx.trainer.policy.new_optimizer(run.lr))
            resumed = True
        ctx.trainer.load_state_dict(trainer_state)
        torch.set_rng_state(rng)
        log(f"[qrl-train] resumed from step {start}")
    total = sft_steps + run.steps
    if start >= total:
        log(f"[qrl-train] the run is complete ({start} steps); raise --qrl-steps to continue")
    logger = MetricsLogger(out, tensorboard=run.tensorboard, tensorboard_dir=run.tensorboard_dir,
                           resume_from_step=start if run.resume else None,
                           warn=log) if main else None
    records: list[dict[str, Any]] = []
    bar = tqdm(range(start, total), desc="qrl-train", disable=not (progress and main),
               file=sys.stderr)
    try:
        with StopRequest(log) as stop:
            for step in bar:
                guard.begin(step)
                if step < sft_steps:
                    rec = sft_step(ctx, step)
                else:
                    if step == start or step == sft_steps:
                        _start_rl(ctx, data, step, resumed and step == start)
                    rec = rl_step(ctx, step, step - sft_steps)
                rec = guard.record(rec)
                records.append(logger.log(rec) if logger is not None else rec)
                bar.set_postfix(_postfix(rec), refresh=False)
                done = step + 1
                path = _save(ctx, out, done, flags, data) \
                    if save_due(run.save_interval, done, sft_steps, total) else None
                signum = world.broadcast(stop.signum) if world.world_size > 1 else stop.signum
                if signum is not None and done < total:
                    if path is None and run.save_interval >= 0:
                        path = _save(ctx, out, done, flags, data)
                    raise RunStopped(stop_line(signum, rec["phase"], step, path), signum)
    finally:
        bar.close()
        ctx.wake_trainer()
        png = logger.close(plot=True) if logger is not None else None
        if ctx.engine is not None:
            ctx.engine.shutdown()
    if png is not None:
        log(f"[qrl-train] metrics: {logger.path}, curves: {png}")
    return logger.records if logger is not None else records
