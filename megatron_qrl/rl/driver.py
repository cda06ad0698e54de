"""The single-process RL driver (no Ray): SFT warm-up, then RL steps, metrics, checkpoints.

Call :func:`run_job` inside an initialised megatron job (``qrl-train`` does it with
:func:`megatron_qrl.models.runtime.single_process_megatron`). Step numbering is global:
SFT steps ``0 .. sft_steps-1``, RL steps ``sft_steps .. sft_steps+steps-1``. The engine holds
weight version ``k`` when RL step ``k`` starts. ``--qrl-model checkpoint`` starts from
``--qrl-checkpoint DIR`` and its tokenizer (:mod:`megatron_qrl.rl.start_model`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_qrl.data import CharTokenizer, addition_problems, tiny_dense_config, tiny_moe_config
from megatron_qrl.data.dataset import PromptRecord, load_prompt_jsonl
from megatron_qrl.models.hf_config import ModelArch, arch_from_dict
from megatron_qrl.rl.checkpoint import load_driver_checkpoint, save_driver_checkpoint
from megatron_qrl.rl.forward import forward_plan
from megatron_qrl.rl.start_model import (
    HFTokenizer,
    StartCheckpoint,
    check_uaq_once,
    load_start_weights,
    load_tokenizer,
    read_start_checkpoint,
)
from megatron_qrl.rl.steps import StepContext, make_loss_fn, rl_step, sft_step
from megatron_qrl.rl.sync import make_engine, sync_weights
from megatron_qrl.rl.trainer import PolicyTrainer, build_policy, make_optimizer
from megatron_qrl.utils.metrics import MetricsLogger

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


def _checkpoint_job(configs: dict[str, Any]) -> tuple[CharTokenizer | HFTokenizer, StartCheckpoint]:
    start = read_start_checkpoint(configs["run"].checkpoint)
    check_uaq_once(start, configs["uaq"].enabled)
    tok = load_tokenizer(start.path)
    if tok.vocab_size > start.arch.vocab_size:
        raise ValueError(f"--qrl-checkpoint {start.path}: the tokenizer has {tok.vocab_size} "
                         f"tokens, the model's vocab_size is {start.arch.vocab_size}; the "
                         "tokenizer does not belong to this model")
    return tok, start


def prepare_job(configs: dict[str, Any]) -> JobData:
    """The task's records, tokenizer and model named by ``--qrl-model`` (no weights read)."""
    run, task = configs["run"], configs["task"]
    if task.prompts:
        records = load_prompt_jsonl(task.prompts)
    else:
        records = [PromptRecord(p["prompt"], p["answer"]) for p in addition_problems(
            task.num_prompts, run.seed, task.digits_min, task.digits_max)]
    if run.model == "checkpoint":
        tok, start = _checkpoint_job(configs)
        return JobData(tok, records, start.hf_config, start.arch, start)
    char = CharTokenizer()
    cfg = (tiny_moe_config if run.model == "tiny-moe" else tiny_dense_config)(char.vocab_size)
    return JobData(char, records, cfg, arch_from_dict(cfg, source=f"--qrl-model {run.model}"))


def _apply_uaq(trainer: PolicyTrainer, data: JobData, scale: float) -> None:
    from megatron_qrl.models.streaming import load_hf_weights
    from megatron_qrl.quant.uaq import apply_uaq

    scaled = apply_uaq(dict(trainer.hf_tensors()), data.hf_config, scale)
    load_hf_weights(trainer.module, data.arch, scaled.__getitem__)


def _seed_megatron(seed: int) -> None:
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _start_rl(ctx: StepContext, data: JobData, step: int, resumed: bool) -> None:
    """Enter the RL phase: fresh Adam at the RL lr, UAQ once, first weight sync."""
    configs = ctx.configs
    policy = ctx.trainer.policy
    if not resumed:
        policy.set_optimizer(make_optimizer(policy.ddp, configs["run"].lr))
        if configs["uaq"].enabled:
            _apply_uaq(ctx.trainer, data, configs["uaq"].scale)
            policy.plan.weights_changed()
    ctx.sync(step)


def _postfix(rec: dict[str, Any]) -> dict[str, str]:
    if rec["phase"] == "sft":
        return {"sft_loss": f"{rec.get('sft_loss', 0):.3f}"}

    def f(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3g}"

    route = {} if rec.get("routing_agreement") is None else {
        "route": f(rec["routing_agreement"])}
    return {"reward": f(rec["reward_mean"]), "kl": f(rec["mismatch_kl"]),
            "clip": f(rec["clip_frac"]), "err": f(rec["error_token_rate"]), **route,
            "t(ro/rc/tr/sy)": "/".join(f"{rec[k]:.2f}" for k in (
                "time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s"))}


def _build(configs: dict[str, Any], data: JobData, engine_factory: EngineFactory,
           start_weights: dict | None) -> StepContext:
    run = configs["run"]
    plan = forward_plan(configs, data.arch)
    _seed_megatron(run.seed)
    trainer = PolicyTrainer(build_policy(data.arch, run.sft_lr, plan))
    if data.start is not None:
        load_start_weights(trainer.module, data.start)
        plan.weights_changed()
    if start_weights is not None:
        trainer.module.load_state_dict(start_weights, strict=False)
        plan.weights_changed()
    engine = engine_factory(configs["rollout"], data.hf_config, run.seed)
    spec, aqn = configs["rollout"].spec, configs["aqn"]

    def sync(version: int) -> Any:
        return sync_weights(trainer.hf_tensors(), engine, spec, version, aqn, run.seed,
                            aqn_step=min(max(version - run.sft_steps, 0), max(run.steps - 1, 0)),
                            total_steps=max(run.steps, 1))

    if hasattr(engine, "bind_resync"):  # Ray modes: a restarted engine actor re-syncs
        engine.bind_resync(sync)
    return StepContext(configs, data.tokenizer, data.records, trainer, engine, plan,
                       make_loss_fn(configs), sync)


def run_job(configs: dict[str, Any], flags: dict[str, Any], *,
            engine_factory: EngineFactory = make_engine, progress: bool = True,
            start_weights: dict | None = None, skip_sft: bool = False,
            log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run SFT (unless ``skip_sft``: e.g. ``start_weights`` are already warmed up) and RL.

    ``flags``: the effective ``--qrl-*`` values (stored in checkpoints, checked on resume).
    Returns the metrics records of this invocation's steps (all of them are in
    ``<output-dir>/metrics.jsonl``).
    """
    from tqdm import tqdm

    run = configs["run"]
    out = Path(run.resolved_output_dir())
    log(f"[qrl-train] output directory: {out}")
    data = prepare_job(configs)
    ctx = _build(configs, data, engine_factory, start_weights)
    sft_steps = 0 if skip_sft else run.sft_steps
    start, resumed = 0, False
    if run.resume:
        state = load_driver_checkpoint(out, flags)
        start = state["next_step"]
        if start > sft_steps:
            ctx.trainer.policy.set_optimizer(make_optimizer(ctx.trainer.policy.ddp, run.lr))
            resumed = True
        ctx.trainer.load_state_dict(state["trainer"])
        torch.set_rng_state(state["rng"])
        log(f"[qrl-train] resumed from step {start}")
    total = sft_steps + run.steps
    logger = MetricsLogger(out, resume_from_step=start if run.resume else None)
    records: list[dict[str, Any]] = []
    bar = tqdm(range(start, total), desc="qrl-train", disable=not progress, file=sys.stderr)
    try:
        for step in bar:
            if step < sft_steps:
                rec = sft_step(ctx, step)
            else:
                if step == start or step == sft_steps:
                    _start_rl(ctx, data, step, resumed and step == start)
                rec = rl_step(ctx, step, step - sft_steps)
            records.append(logger.log(rec))
            bar.set_postfix(_postfix(rec), refresh=False)
            done = step + 1
            rl_done = done - sft_steps
            if done == sft_steps or done == total or (
                    rl_done > 0 and run.save_interval and rl_done % run.save_interval == 0):
                save_driver_checkpoint(out, done, ctx.trainer.state_dict(), flags)
    finally:
        bar.close()
        png = logger.close(plot=True)
        ctx.engine.shutdown()
    if png is not None:
        log(f"[qrl-train] metrics: {logger.path}, curves: {png}")
    return records
