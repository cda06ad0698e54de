"""One supervised warm-up step and one RL step of the driver (pure orchestration).

RL step: sample prompts -> group sampling (``n`` per prompt) on the engine
-> rewards -> GRPO advantages -> pi_prox recompute on the trainer (forward only, routing
replay if on; the first update's own forward gives its pi_prox instead where
``config.prox_from_first_update`` says so, :func:`set_old_log_probs`) -> ``updates_per_step``
optimizer steps with the chosen policy loss through the losses' Megatron adapter -> weight
sync (AQN on the engine copy) -> metrics.

Multi-rank: only rank 0 has an engine; it samples and scores, and the packed batch, rewards
and texts are broadcast so that every rank holds the same batch; each data-parallel rank
trains on its share of every optimizer step's micro batches (``RankWorld.local``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from megatron_qrl.config import QrlArgumentError, prox_from_first_update
from megatron_qrl.config.configs import QrlConfigs
from megatron_qrl.data import CharTokenizer
from megatron_qrl.data.dataset import PromptRecord
from megatron_qrl.data.synthetic import noisy_demos
from megatron_qrl.losses import grpo_advantages
from megatron_qrl.models.runtime import RankWorld
from megatron_qrl.rewards import score_math
from megatron_qrl.rl.batch import pack_samples, pad_to_multiple, sft_batch, split_batch
from megatron_qrl.rl.forward import ForwardPlan
from megatron_qrl.rl.micro_forward import positions_run
from megatron_qrl.rl.trainer import PolicyTrainer
from megatron_qrl.rollout.base import RolloutEngine, SamplingParams, sync_record
from megatron_qrl.rollout.capacity import capacity_record
from megatron_qrl.utils.io import atomic_write_json
from megatron_qrl.utils.profile import Traced

__all__ = ["StepContext", "micro_batches", "recompute_log_probs", "rl_step", "sample_indices",
           "set_old_log_probs", "sft_step", "step_seed"]


def step_seed(seed: int, step: int, salt: int) -> int:
    """A seed that depends only on ``(seed, step, salt)``: steps never share RNG state, so a
    resumed run samples exactly what the uninterrupted one did."""
    return (seed * 1_000_003 + step * 7_919 + salt * 104_729) % (2**62)


def sample_indices(num_records: int, k: int, seed: int, step: int) -> list[int]:
    """``k`` record indices for ``step`` (without replacement when ``k <= num_records``)."""
    gen = torch.Generator().manual_seed(step_seed(seed, step, 1))
    if k <= num_records:
        return torch.randperm(num_records, generator=gen)[:k].tolist()
    return torch.randint(num_records, (k,), generator=gen).tolist()


@dataclass
class StepContext:
    """Everything a step needs (built once by the driver)."""

    configs: QrlConfigs
    tokenizer: CharTokenizer
    """The char tokenizer or a ``rl.start_model.HFTokenizer`` (``bos_id`` may be None)."""
    records: Sequence[PromptRecord]
    trainer: PolicyTrainer
    engine: RolloutEngine
    plan: ForwardPlan
    loss_fn: Callable
    sync: Callable[[int], Any]
    """``sync(version)``: push the trainer's weights to the engine as ``version``."""
    world: RankWorld = RankWorld()
    """This rank of the job (rank 0 owns ``engine``; None on the other ranks)."""
    seq_length: int | None = None
    """Megatron ``--seq-length``: longest prompt + response a batch may hold (None: any)."""

    seq_multiple: int = 1
    """Sequence lengths are padded to a multiple of this (TP size under sequence parallel)."""

    release_engine_memory: bool = False
    """Single mode, an in-process SGLang engine sharing the trainer's GPU: release its memory
    after each rollout (before recompute + train) and resume it before the weight sync
    (``--qrl-rollout-sglang-release-memory``; the Ray colocated engine does it itself)."""

    sleeper: Any = None
    """``rl.trainer_sleep.TrainerSleep`` when the trainer sleeps while the engine decodes
    (``--qrl-trainer-sleep``); None: the trainer stays on its device."""

    engine_released: bool = False
    """Whether the engine's memory is released now (``engine_memory``)."""

    sync_quantization: str = ""
    """How the weight sync quantizes (``rl.qcache_sync.QCacheSync.describe``), for the log."""

    def engine_memory(self, release: bool) -> float:
        """Release (or resume) the engine's GPU memory when ``release_engine_memory`` and it
        is not so already. Before a resume the trainer's cached free blocks go back to the
        driver (``torch.cuda.empty_cache``): the activations of recompute + train, freed but
        still reserved by the caching allocator, would otherwise leave the engine too little.
        Returns the seconds it took (0.0: nothing to do)."""
        if self.release_engine_memory and self.world.is_main and self.engine is not None \
                and release != self.engine_released:
            t0 = time.perf_counter()
            if not release and torch.cuda.is_available():
                torch.cuda.empty_cache()
            (self.engine.release_memory if release else self.engine.resume_memory)()
            self.engine_released = release
            return time.perf_counter() - t0
        return 0.0

    def sleep_trainer(self, keep_params: bool = False) -> float:
        """Seconds the trainer took to fall asleep (``keep_params``: its weights stay for the
        weight sync); 0.0 without a sleeper."""
        return 0.0 if self.sleeper is None else self.sleeper.sleep(keep_params).seconds

    def wake_trainer(self, defer_state: bool = False) -> float:
        """Seconds the trainer took to wake (its state back on its device); 0.0 when awake.
        ``defer_state``: the optimizer state comes back behind the weights, ready before the
        optimizer step (``rl.trainer_sleep``; the trainer's ``before_step`` hook)."""
        return self.sleeper.wake(defer_state).seconds if self.sleeper is not None and \
            self.sleeper.asleep else 0.0

    def before_sync(self) -> tuple[float, float]:
        """Make room for the weight sync: the trainer's optimizer state to sleep (weights
        stay), the engine's memory resumed. Returns the seconds of the sleep and of the
        resume."""
        slept = self.sleep_trainer(keep_params=True)
        return slept, self.engine_memory(release=False)

    def check_length(self, batch: dict) -> dict:
        """``batch`` padded to ``seq_multiple``; raise naming ``--seq-length`` when longer."""
        s = batch["tokens"].shape[1]
        if self.seq_length is not None and s > self.seq_length:
            raise QrlArgumentError(f"a batch holds {s} tokens (prompt + response), more than "
                             f"--seq-length {self.seq_length}; raise --seq-length or lower "
                             "--qrl-rollout-max-new-tokens")
        return pad_to_multiple(batch, self.seq_multiple, self.tokenizer.pad_id)

    def prompt_ids(self, rec: PromptRecord) -> list[int]:
        bos = self.tokenizer.bos_id
        return [*(() if bos is None else (bos,)), *self.tokenizer.encode(rec.prompt)]


def _sft_loss(batch: dict, output_tensor: torch.Tensor, non_loss_data: bool = False):
    from megatron_qrl.losses.megatron_adapter import batch_log_probs, vocab_parallel_log_probs

    lp, _ = batch_log_probs(lambda x, labels: (vocab_parallel_log_probs(x, labels), None),
                            output_tensor, batch)  # a packed forward: back to [B, S]
    mask = batch["loss_mask"].float()
    loss = -(lp * mask).sum() / mask.sum().clamp_min(1.0)
    correct = (lp > -0.6931).float()  # the answer token has probability > 1/2
    # clone: megatron's schedule divides the returned loss by the number of micro batches
    # IN PLACE, which a detached view would follow
    return loss, {"sft_loss": loss.detach().clone(),
                  "sft_token_acc": (correct * mask).sum() / mask.sum().clamp_min(1.0)}


def sft_step(ctx: StepContext, step: int) -> dict[str, Any]:
    """One supervised step on ``prompts_per_step * n`` task answers (+ ``<eos>``), a
    ``--qrl-task-demo-noise`` fraction of them with a spurious trailing 0
    (:func:`~megatron_qrl.data.synthetic.noisy_demos`)."""
    run = ctx.configs.run
    size = run.prompts_per_step * ctx.configs.rollout.n_samples_per_prompt
    t0 = time.perf_counter()
    recs = [ctx.records[i] for i in sample_indices(len(ctx.records), size, run.seed, step)]
    demos = noisy_demos([r.answer for r in recs], ctx.configs.task.demo_noise,
                        step_seed(run.seed, step, 3))
    batch = sft_batch([ctx.prompt_ids(r) for r in recs],
                      [[*ctx.tokenizer.encode(d), ctx.tokenizer.eos_id] for d in demos])
    batch = ctx.check_length(batch)
    metrics, grad_norm = ctx.trainer.train_step(
        ctx.world.local(split_batch(batch, run.micro_batch_size), 1), _sft_loss,
        per_token_loss=False)
    return {"step": step, "phase": "sft", "reward_mean": None, "mismatch_kl": None,
            "clip_frac": None, "error_token_rate": None, "time_rollout_s": 0.0,
            "time_train_s": time.perf_counter() - t0, "time_sync_s": 0.0,
            "grad_norm": grad_norm, **metrics}


def _rollout(ctx: StepContext,
             step: int) -> tuple[dict, torch.Tensor, list[str], int, int | None]:
    run, ro = ctx.configs.run, ctx.configs.rollout
    n = ro.n_samples_per_prompt
    recs = [ctx.records[i] for i in sample_indices(len(ctx.records), run.prompts_per_step,
                                                    run.seed, step)]
    prompts = [ctx.prompt_ids(r) for r in recs for _ in range(n)]
    sampling = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
                              top_p=ro.top_p, top_k=ro.top_k, stop=tuple(ro.stop),
                              stop_token_ids=(ctx.tokenizer.eos_id,),
                              seed=step_seed(run.seed, step, 2), group_size=n)
    out = ctx.engine.generate(prompts, sampling)
    responses = out.responses()
    vocab = ctx.tokenizer.vocab_size  # ids of the padded vocabulary tail decode to nothing
    texts = [ctx.tokenizer.decode([i for i in r if i < vocab]) for r in responses]
    bonus = ctx.configs.task.format_bonus
    scores = [score_math(t, recs[i // n].answer, bonus) for i, t in enumerate(texts)]
    rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32)
    lps = [row[m] for row, m in zip(out.logprobs, out.mask)]
    batch = pack_samples(prompts, responses, lps, ctx.tokenizer.pad_id, out.routed_experts)
    groups = torch.arange(len(recs)).repeat_interleave(n)
    batch["advantages"] = grpo_advantages(rewards, groups)
    concurrency = capacity_record(ctx.engine.capacity(),
                                  [len(p) + len(r) for p, r in zip(prompts, responses)])
    return batch, rewards, texts, sum(s.over_budget for s in scores), concurrency


def rl_step(ctx: StepContext, step: int, rl_index: int) -> dict[str, Any]:
    """One RL step (rollout, recompute, updates, sync); returns its metrics record.

    ``step`` is the global step (metrics, seeds), ``rl_index`` the 0-based RL step (AQN stage).
    """
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    start = time.perf_counter()
    # the engine decodes beside the trainer's weights only: its state slept before the last
    # sync (the weights, which the sync read, stay: the engine's memory was resumed before it)
    slept = ctx.sleep_trainer(keep_params=True)
    asleep_gib = torch.cuda.memory_allocated() / 2**30 if cuda and ctx.sleeper else None
    t0 = time.perf_counter()
    batch, rewards, texts, over_budget, concurrency = ctx.world.from_main(lambda: _rollout(ctx, step))
    batch = ctx.check_length(batch)
    released = ctx.engine_memory(release=True)  # the trainer's recompute + update run next
    profiled = _profiler(ctx, step)
    t_rollout = time.perf_counter()
    with profiled:
        # the optimizer state follows the weights, overlapping the recompute + forward / backward
        woke = ctx.wake_trainer(defer_state=True)
        t1 = time.perf_counter()
        groups = micro_batches(ctx, batch)
        mbs = [mb for group in groups for mb in group]
        first = prox_from_first_update(ctx.configs)
        with record_function("qrl.recompute"):
            recompute = set_old_log_probs(ctx, groups, first)
        counts = [ctx.trainer.last_routing_counts] if recompute else []
        t2 = time.perf_counter()
        with record_function("qrl.train"):  # routing: of the forwards that gave pi_prox
            updates = [ctx.trainer.train_step(group, ctx.loss_fn, routing=first and i == 0)
                       for i, group in enumerate(groups)]
        if first:
            counts.append(ctx.trainer.last_routing_counts)
        t3 = time.perf_counter()
    slept_state, resumed = ctx.before_sync()
    t_sync = t3 + slept_state  # the engine's resume counts in the sync, as it always did
    synced = ctx.sync(step + 1)
    t4 = time.perf_counter()
    # the phases are disjoint: rollout, recompute, train, sync, and sleep / wake apart
    rec = _record(step, rewards, texts, batch, updates,
                  (t0, t_rollout, t1, t2, t3, t_sync, t4))
    rec["time_step_s"] = t4 - start
    if ctx.release_engine_memory:  # inside time_rollout_s / time_sync_s: the engine's memory
        rec.update(time_engine_release_s=released,
                   time_engine_resume_s=resumed)
    if ctx.sleeper is not None:  # the trainer slept through the rollout (rl.trainer_sleep)
        rec.update(time_sleep_s=slept + slept_state, time_wake_s=woke,
                   trainer_gpu_gib_asleep=asleep_gib)
    rec.update(concurrency)  # the engine's limits and the waves (rollout.capacity), if reported
    rec.update(sync_record(ctx.engine))  # the engine's account of the sync, if it keeps one
    if getattr(synced, "adapter_bytes", None) is not None:  # LoRA: adapters over the wire
        rec["sync_adapter_bytes"] = synced.adapter_bytes
    if getattr(synced, "cached", None) is not None:  # quantized once, in the trainer's cache
        rec["sync_cached_tensors"] = synced.cached
    # positions the trainer ran on this rank (padding included; bench/rl_step.py's MFU)
    pack = getattr(ctx.trainer, "pack_multiple", lambda: None)()  # --qrl-pack-sequences
    rec["trained_tokens"] = sum(positions_run(mb, pack) for mb in mbs)
    rec["recomputed_tokens"] = sum(positions_run(mb, pack) for mb in recompute)
    rec["trainer_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    rec["trainer_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
    # cudaFree + retry of the caching allocator this step: the GPU was full (a slow step)
    rec["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries \
        if cuda else None
    if isinstance(profiled, Traced):
        rec.update(_profile_record(ctx, step, profiled))
    fleet = getattr(ctx.engine, "metrics", None)  # a rollout fleet's per-engine metrics
    return {**rec, "routing_agreement": _agreement(counts), "reward_over_budget": over_budget,
            **(fleet() if callable(fleet) else {})}


def _profiler(ctx: StepContext, step: int) -> Traced | contextlib.nullcontext:
    """torch.profiler over the trainer's phases of RL step ``step`` where it is
    ``--qrl-profile-step``, else nothing."""
    if ctx.configs.run.profile_step != step:
        return contextlib.nullcontext()
    return Traced("cuda" if torch.cuda.is_available() else "cpu")


def _profile_record(ctx: StepContext, step: int, traced: Traced) -> dict[str, Any]:
    """The profiled phases' summary (:meth:`Traced.summary`) written to
    <output-dir>/profile_step<N>.summary.json (with ``--qrl-profile-trace`` the Chrome trace
    beside it); the step's metrics get its scalars: ``profile_wall_s``,
    ``profile_gpu_busy_s``, ``profile_recompute_s`` / ``profile_train_s`` (the ranges' wall),
    ``profile_host_syncs``, ``profile_device_allocs`` and ``profile_device_alloc_ms`` (the
    caching allocator's cudaMalloc / cudaFree / VMM calls and their host time), and
    ``profile_summary`` (the file)."""
    out = traced.summary(top=25)
    rank = f"_rank{ctx.world.rank}" if ctx.world.world_size > 1 else ""
    stem = Path(ctx.configs.run.resolved_output_dir()) / f"profile_step{step}{rank}"
    if ctx.configs.run.profile_trace:
        out["trace"] = traced.export(stem.with_suffix(".json"))
    summary = atomic_write_json(stem.with_suffix(".summary.json"), out)
    ranges = out["ranges_ms"]
    return {
        "profile_wall_s": out["wall_s"], "profile_gpu_busy_s": out["gpu_busy_s"],
        "profile_recompute_s": ranges.get("qrl.recompute", 0.0) / 1e3,
        "profile_train_s": ranges.get("qrl.train", 0.0) / 1e3,
        "profile_host_syncs": sum(out["host_syncs"].values()),
        "profile_device_allocs": sum(n for n, _ in out["allocator"].values()),
        "profile_device_alloc_ms": sum(ms for _, ms in out["allocator"].values()),
        "profile_summary": str(summary),
    }


def set_old_log_probs(ctx: StepContext, groups: list[list[dict]], first: bool) -> list[dict]:
    """Give every micro batch its pi_prox (``old_log_probs``); returns those recomputed.

    ``first`` (``config.prox_from_first_update``): the first update's micro batches get None —
    the loss takes this forward's own log-probs, detached (its weights are pi_prox's) — and the
    recompute runs on the later updates' only; else on every micro batch."""
    recompute = [mb for group in groups[1:] for mb in group] if first else \
        [mb for group in groups for mb in group]
    for mb in groups[0] if first else ():
        mb["old_log_probs"] = None
    for mb, lp in zip(recompute, recompute_log_probs(ctx, recompute) if recompute else []):
        mb["old_log_probs"] = lp
    return recompute


def _agreement(counts: list[tuple[float, int] | None]) -> float | None:
    """Routing agreement over the forwards that gave pi_prox (``PolicyTrainer`` counts)."""
    have = [c for c in counts if c is not None]
    tokens = sum(n for _, n in have)
    return sum(a for a, _ in have) / tokens if tokens else None


def recompute_log_probs(ctx: StepContext, mbs: list[dict]) -> list[torch.Tensor]:
    """pi_prox of every micro batch (forward only), on micro batches joined up to
    ``--qrl-log-prob-max-tokens`` (``rl.microbatch.merge_micro_batches``) when it is set."""
    budget = ctx.configs.run.log_prob_max_tokens
    if not budget:
        return ctx.trainer.log_probs(mbs, ctx.loss_fn)
    from megatron_qrl.rl.microbatch import merge_micro_batches

    merged, spans = merge_micro_batches(mbs, budget, ctx.tokenizer.pad_id)
    out = ctx.trainer.log_probs(merged, ctx.loss_fn)
    return [out[g][first:end, :length].contiguous() for g, first, end, length in spans]


def micro_batches(ctx: StepContext, batch: dict) -> list[list[dict]]:
    """This rank's micro batches of each optimizer step of an RL step: padded rows of
    ``--qrl-micro-batch-size``, or by ``--qrl-max-tokens-per-micro-batch`` (rl.microbatch)."""
    run, world = ctx.configs.run, ctx.world
    if run.max_tokens_per_micro_batch:
        from megatron_qrl.rl.microbatch import budget_micro_batches

        return budget_micro_batches(batch, run.max_tokens_per_micro_batch, run.updates_per_step,
                                    world.dp_size, world.dp_rank, ctx.seq_multiple,
                                    ctx.tokenizer.pad_id)
    mbs = world.local(split_batch(batch, run.micro_batch_size), run.updates_per_step)
    per_update = len(mbs) // run.updates_per_step
    return [mbs[u * per_update:(u + 1) * per_update] for u in range(run.updates_per_step)]


def _nonneg(v: float | None) -> float | None:
    """The k3 estimate of a KL is >= 0 in exact arithmetic; fp32 gives ~-1e-10 at equality."""
    return None if v is None else max(float(v), 0.0)


def _record(step: int, rewards: torch.Tensor, texts: list[str], batch: dict,
            updates: list[tuple[dict, float]], t: tuple[float, ...]) -> dict[str, Any]:
    """The step's metrics; ``t``: the rollout's start and end, the recompute's start and end,
    the train's end, the sync's start and end (a sleeping trainer's wake lies between the
    rollout and the recompute, its sleep before the sync: ``time_wake_s`` / ``time_sleep_s``)."""
    first = updates[0][0]  # the first update sees pi_theta == pi_prox: its KL is the mismatch
    keys = {k for m, _ in updates for k in m}
    agg = {k: (max if k.endswith("_max") else _mean)([m[k] for m, _ in updates if k in m])
           for k in keys}
    mask = batch["loss_mask"]
    return {
        "step": step, "phase": "rl", "reward_mean": float(rewards.mean()),
        "accuracy": float((rewards >= 1.0).float().mean()),
        "mismatch_kl": _nonneg(first.get("kl_behav_prox_k3")),
        "clip_frac": agg.get("clip_frac_low", 0.0) + agg.get("clip_frac_high", 0.0),
        "error_token_rate": agg.get("error_token_rate"),
        "response_len": float(mask.sum(1).float().mean()),
        # -log pi_behav of the sampled tokens: a Monte-Carlo estimate of the rollout entropy
        "rollout_nll": float(-(batch["rollout_log_probs"] * mask).sum() / mask.sum().clamp_min(1)),
        "time_rollout_s": t[1] - t[0], "time_recompute_s": t[3] - t[2],
        "time_train_s": t[4] - t[3], "time_sync_s": t[6] - t[5],
        "grad_norm": _mean([g for _, g in updates]), "sample": texts[0],
        **{k: v for k, v in agg.items() if k not in ("loss",)},
    }


def _mean(v: Sequence[float]) -> float:
    return sum(v) / len(v)


def make_loss_fn(configs: QrlConfigs) -> Callable:
    """The policy loss (losses' Megatron adapter) for ``--qrl-loss-*`` / ``--qrl-error-tokens-*``."""
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc

    return partial(PolicyLossFunc(configs.loss, configs.error_tokens,
                                  temperature=configs.rollout.temperature))
