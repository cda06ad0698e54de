"""The trainer side of the RL loop: a megatron-core GPTModel, its DDP wrapper and optimizer.

:func:`build_policy` is the ONE place the policy model is built; the rollout-aligned forward
and routing replay plug in through its :class:`~megatron_qrl.rl.forward.ForwardPlan` (spec
hook, config overrides, aligned-forward state, ``moe.RoutingReplay``).

Every forward / backward goes through megatron-core's ``get_forward_backward_func()``:
- :meth:`PolicyTrainer.log_probs`: forward only, ``collect_non_loss_data=True``; the loss
  function returns the per-token log-probs (pi_prox recompute);
- :meth:`PolicyTrainer.train_step`: forward + backward over micro batches and one optimizer
  step (the policy loss through the losses' Megatron adapter, or the SFT loss).
Each micro batch's forward is ``rl.micro_forward.forward_step``: padded ``[B, S]``, or packed
into one THD row (``TrainerOptions.pack_sequences``, ``--qrl-pack-sequences``).

Run inside an initialised megatron job (:func:`megatron_qrl.models.runtime.single_process_megatron`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.rl.forward import ForwardPlan
from megatron_qrl.rl.guard import BadStepGuard, guarded_step, host_scalars
from megatron_qrl.rl.micro_forward import forward_step as _forward_step
from megatron_qrl.rl.micro_forward import pack_group, pack_multiple
from megatron_qrl.rl.micro_forward import routing_counts as _routing_counts  # noqa: F401
from megatron_qrl.rl.pipeline import (
    layer_weighted_sum,
    log_probs_from_last,
    metrics_from_last,
    stream_to_main,
    uniform_shape,
)


@dataclass(frozen=True)
class TrainerOptions:
    """How the trainer is built and steps (from the Megatron flags after ``--``)."""

    transformer_impl: str = "auto"
    """``models.builder.TRANSFORMER_IMPLS``: transformer_engine, local (SDPA attention) or
    auto (TE where it imports and a GPU is present)."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: fp32 masters + Adam state sharded over data-parallel
    ranks, gradients reduce-scattered (``--use-distributed-optimizer``)."""
    optimizer_cpu_offload: bool = False
    """``--optimizer-cpu-offload``: megatron-core's HybridDeviceOptimizer keeps
    ``optimizer_offload_fraction`` of the optimizer state on the CPU and steps it there."""
    optimizer_offload_fraction: float = 1.0
    """Share of the optimizer state offloaded (with ``optimizer_cpu_offload``)."""
    per_token_loss: bool = False
    """Policy-loss steps normalise by the step's total loss tokens (Megatron's
    ``calculate_per_token_loss``): the objective is the global token mean of the optimizer
    step, independent of how samples are grouped into micro batches (token-budget batches)."""
    pack_sequences: bool = False
    """Run each micro batch packed (THD, ``--qrl-pack-sequences``; ``rl.micro_forward``): its
    samples back to back in one row with ``PackedSeqParams``, no padding in the layers."""

    @classmethod
    def from_flags(cls, mega: Any, per_token_loss: bool = False,
                   pack_sequences: bool = False) -> TrainerOptions:
        """The options of parsed Megatron flags (``config.megatron_flags.MegatronSettings``)."""
        return cls(transformer_impl=mega.transformer_impl,
                   distributed_optimizer=mega.distributed_optimizer,
                   optimizer_cpu_offload=mega.optimizer_cpu_offload,
                   optimizer_offload_fraction=mega.optimizer_offload_fraction,
                   per_token_loss=per_token_loss, pack_sequences=pack_sequences)

    def __post_init__(self) -> None:
        if self.optimizer_cpu_offload and not self.distributed_optimizer:
            raise ValueError("TrainerOptions: optimizer_cpu_offload needs distributed_optimizer")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError("TrainerOptions.optimizer_offload_fraction must be in [0, 1]")


@dataclass
class PolicyModel:
    """A DDP-wrapped megatron-core model, its optimizer and config."""

    ddp: Any
    optimizer: Any
    config: Any
    arch: ModelArch
    plan: ForwardPlan
    groups: Any = None
    """``models.streaming.ShardGroups`` of a multi-rank job (None: one process)."""
    bf16: bool = False
    """BF16 parameters with fp32 master weights (megatron's mixed-precision optimizer)."""
    options: TrainerOptions = TrainerOptions()

    def new_optimizer(self, lr: float) -> Any:
        """A fresh optimizer (new moments) at ``lr`` of the same precision."""
        return make_optimizer(self.ddp, lr, bf16=self.bf16, options=self.options)

    def set_optimizer(self, optimizer: Any) -> None:
        """Use ``optimizer`` from now on (the aligned-forward cache follows its steps)."""
        self.optimizer = optimizer
        self.plan.attach(optimizer)  # a ChainedOptimizer (EP > 1) hooks each of its members


def build_policy(arch: ModelArch, lr: float, plan: ForwardPlan | None = None,
                 clip_grad: float = 1.0, weight_decay: float = 0.0, layout: Any = None,
                 groups: Any = None, bf16: bool = False,
                 options: TrainerOptions | None = None) -> PolicyModel:
    """Build the policy (fp32 masters), wrap it in megatron DDP and make an Adam optimizer.

    ``plan.spec_hook`` maps the decoder layer ModuleSpec (aligned linears, replay routers);
    ``plan.config_overrides`` go to the ``TransformerConfig``. ``layout``: the
    ``models.builder.ParallelLayout`` of a multi-rank job (megatron's ``parallel_state`` must
    match it) and ``groups`` its ``models.streaming.ShardGroups``; None: one process.
    ``bf16``: BF16 parameters, fp32 gradient reduction and fp32 master weights in Adam.
    ``options``: layer implementation, distributed optimizer / CPU offload, loss normalisation.
    """
    plan = plan or ForwardPlan()
    options = options or TrainerOptions()
    _check_expert_layout(arch, layout)
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_qrl.models.runtime import build_model

    dtype = torch.bfloat16 if bf16 else torch.float32
    overrides = dict(plan.config_overrides)
    # a forward plan that needs one layer implementation (LoRA: the local spec) names it
    use_te = overrides.pop("use_te", options.transformer_impl)
    if use_te is False and options.transformer_impl == "transformer_engine":
        raise ValueError("--transformer-impl transformer_engine with --qrl-lora-rank > 0: the "
                         "LoRA linears swap into megatron-core's local spec (SDPA attention); "
                         "drop --transformer-impl or pass --transformer-impl local")
    model = build_model(arch, layout, dtype, spec_hook=plan.spec_hook, use_te=use_te,
                        stage=None if groups is None else groups.stage, **overrides)
    if plan.prepare_model is not None:
        plan.prepare_model(model)
    if plan.aligned is not None:  # errors of the Q(W) refresh name the weight
        plan.aligned.name_modules(model)
    config = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16, use_distributed_optimizer=options.distributed_optimizer)
    ddp = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    policy = PolicyModel(ddp, None, config, arch, plan, groups, bf16, options)
    policy.set_optimizer(make_optimizer(ddp, lr, clip_grad, weight_decay, bf16, options))
    return policy


def _check_expert_layout(arch: ModelArch, layout: Any) -> None:
    """Refuse a MoE layout whose expert gradients megatron-core would never sum.

    megatron-core 0.16.1 marks expert weights ``allreduce=True`` when EP = 1, so their
    gradients join the dense data-parallel reduction, which leaves the TP ranks out. Under
    sequence parallelism with ETP < TP each TP rank's experts see only their slice of the
    tokens (the dispatcher gathers over ETP x EP ranks): the gradients stay partial sums and
    the expert copies drift apart from the first step."""
    if layout is None or not arch.is_moe or layout.ep > 1 or layout.etp >= layout.tp:
        return
    if layout.tp > 1 if layout.sequence_parallel is None else layout.sequence_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {layout.tp} --expert-tensor-parallel-size "
            f"{layout.etp} --expert-model-parallel-size 1 with --sequence-parallel: megatron-core "
            "would not sum the experts' gradients over the TP ranks (each sees its slice of the "
            f"tokens); use --expert-tensor-parallel-size {layout.tp} (the default) or "
            "--expert-model-parallel-size > 1")


def make_optimizer(ddp: Any, lr: float, clip_grad: float = 1.0, weight_decay: float = 0.0,
                   bf16: bool = False, options: TrainerOptions | None = None) -> Any:
    """A fresh megatron-core Adam optimizer over ``ddp`` (new moments; used per phase);
    ``bf16``: the mixed-precision optimizer (fp32 master copies of the BF16 parameters);
    ``options``: distributed optimizer / CPU offload."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    options = options or TrainerOptions()
    extra: dict[str, Any] = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    if options.distributed_optimizer:
        extra["use_distributed_optimizer"] = True
    if options.optimizer_cpu_offload:
        extra.update(optimizer_cpu_offload=True,
                     optimizer_offload_fraction=options.optimizer_offload_fraction)
    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, clip_grad=clip_grad, weight_decay=weight_decay,
                        adam_beta2=0.99, **extra), [ddp])


def set_lr(optimizer: Any, lr: float) -> None:
    """Set the learning rate of every parameter group of a megatron optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class PolicyTrainer:
    """Forward-only log-probs and optimizer steps of one :class:`PolicyModel`."""

    def __init__(self, policy: PolicyModel) -> None:
        self.policy = policy
        self.last_routing_agreement: float | None = None
        """Mean over MoE layers of the fraction of (token, expert) choices of the last
        :meth:`log_probs` (pi_prox recompute) where the trainer's own top-k equals the
        engine's routed experts; None for dense models or rollouts without routing."""
        self.last_routing_counts: tuple[float, int] | None = None
        """``(summed agreement, tokens)`` behind it, of the last :meth:`log_probs` or
        :meth:`train_step` with ``routing=True`` (over every rank); None: nothing measured."""
        self.guard: BadStepGuard | None = None
        """Skips updates with a non-finite loss / grad norm (``rl.guard``; None: plain steps)."""
        self.before_step: list[Callable[[], Any]] = []
        """Called before every optimizer step, after the forward / backward: a sleeping
        trainer's ``rl.trainer_sleep.TrainerSleep.state_ready`` (its optimizer state woken
        behind the weights, overlapping the forward / backward)."""
        self.stream_buffers: dict[str, torch.Tensor] = {}
        """The query / key / value split out of each fused ``linear_qkv`` for
        :meth:`hf_tensors` with ``persistent`` (made at its first use, rewritten by every stream):
        the same memory every sync, so an engine that holds the trainer's tensors across
        syncs holds these too (one more copy of those weights: ~1.1 GB for Qwen3-4B)."""

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (no DDP wrapper)."""
        return self.policy.ddp.module

    @property
    def stage(self) -> Any:
        """This rank's ``models.stages.PipelineStage`` under pipeline parallelism, else None."""
        groups = self.policy.groups
        stage = None if groups is None else groups.stage
        return stage if stage is not None and stage.size > 1 else None

    def pack_multiple(self) -> int | None:
        """None: padded micro batches; else they run packed (``--qrl-pack-sequences``) with
        the packed length a multiple of this (``rl.micro_forward.pack_multiple``)."""
        return pack_multiple(self.policy.config) if self.policy.options.pack_sequences else None

    def _run(self, microbatches: Sequence[dict], loss_fn: Callable, forward_only: bool,
             routing_sink: list | None = None) -> list:
        """Megatron's schedule over ``microbatches``; then the aligned forward's Q(W) refresh
        of this step, if it ran here, is checked for NaN / Inf (one host sync, before the
        step's reads of the results: ``te_quant.state``)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not microbatches:
            raise ValueError("PolicyTrainer: no micro batches given")
        b, s = microbatches[0]["tokens"].shape if self.stage is None else \
            uniform_shape(microbatches)  # the schedule's one activation shape
        replay, pack = self.policy.plan.replay, self.pack_multiple()
        phase, record = "recompute" if forward_only else "update", routing_sink is not None
        if replay is not None and not replay.reads_ids(phase, record):
            microbatches = [{k: v for k, v in mb.items() if k != "routed_experts"}
                            for mb in microbatches]  # nothing reads them in this forward
        elif replay is not None:  # on the host, before the micro batches move to the device
            for mb in microbatches:
                if mb.get("routed_experts") is not None:  # -1: never routed (replay_ids)
                    # the largest id decides (ids below 0 become expert 0): one pass, no copy
                    replay.check_values(mb["routed_experts"].amax().clamp_min(0))
        ctx = replay.use(None, phase, record=record) \
            if replay is not None else contextlib.nullcontext()
        with ctx:
            store = get_forward_backward_func()(
                forward_step_func=partial(_forward_step, loss_fn=loss_fn, replay=replay,
                                          routing_sink=routing_sink, kv=self.policy.plan.kv,
                                          pack=pack, group=None if pack is None else
                                          pack_group(self.policy.config)),
                data_iterator=iter(microbatches), model=[self.policy.ddp],
                num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
                forward_only=forward_only, collect_non_loss_data=forward_only)
        if self.policy.plan.aligned is not None:  # before anything reads the results
            self.policy.plan.aligned.check_finite()  # the Q(W) refresh's: one sync, if any
        return store

    @torch.no_grad()
    def log_probs(self, microbatches: Sequence[dict], loss_fn: Callable) -> list[torch.Tensor]:
        """Per-token log-probs of ``labels`` for every micro batch (no grad; pi_prox; routing
        replayed when ``--qrl-routing-replay`` is recompute or all)."""
        self.policy.ddp.eval()
        sink: list[tuple[float, int]] = []
        try:
            store = self._run(microbatches, loss_fn, True, sink)
        finally:
            self.policy.ddp.train()
        self._routing_totals(sink)
        a_t = self.last_routing_counts
        self.last_routing_agreement = a_t[0] / a_t[1] if a_t else None
        if self.stage is not None:  # computed on the last stage
            return log_probs_from_last(self.stage, store, microbatches)
        return [d["log_probs"].float() for d in store]

    def _routing_totals(self, sink: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Sum the per-micro-batch routing counts of ``sink`` (device tensors,
        ``rl.micro_forward.routing_counts``) and over ranks (multi-rank: over the TP token
        slices under sequence parallelism and the data-parallel shares) into
        :attr:`last_routing_counts` (None when no forward measured any token): one host read
        per call, not one per micro batch."""
        both = torch.zeros(3, dtype=torch.float64)
        if sink:  # summed where the counts are, read once
            sums = torch.stack([torch.stack([a.double(), n.double()]) for a, n in sink]).sum(0)
            both = torch.cat([sums.cpu(), both.new_ones(1)])
        if self.policy.groups is not None:  # multi-rank: sum over token slices / DP shares
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            if self.stage is not None:  # each stage measured its own MoE layers
                both = layer_weighted_sum(self.stage, both,
                                          len(self.module.decoder.layers) if sink else 0)
            if self.policy.config.sequence_parallel:  # each TP rank saw its token slice
                dist.all_reduce(both, group=ps.get_tensor_model_parallel_group())
            dist.all_reduce(both, group=ps.get_data_parallel_group())
        agree, tokens = float(both[0]), int(both[1])
        self.last_routing_counts = (agree, tokens) if tokens else None

    def train_step(self, microbatches: Sequence[dict], loss_fn: Callable,
                   per_token_loss: bool | None = None,
                   routing: bool = False) -> tuple[dict[str, float], float]:
        """Forward/backward over ``microbatches`` and one optimizer step.

        ``per_token_loss`` (default: ``TrainerOptions.per_token_loss``): the loss function
        returns ``(loss * tokens, tokens, metrics)`` and the gradient is divided by the step's
        total tokens (over data-parallel ranks too) instead of per micro batch — the global
        token mean, whatever the micro batches. Returns the loss function's metrics averaged
        over micro batches and the grad norm. ``routing``: also measure the routing agreement
        of these forwards (:attr:`last_routing_counts`; the first update of an RL step whose
        forward gives pi_prox, ``rl.steps.set_old_log_probs``).
        """
        ddp, optimizer = self.policy.ddp, self.policy.optimizer
        config = self.policy.config
        per_token = self.policy.options.per_token_loss if per_token_loss is None \
            else per_token_loss
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        saved, config.calculate_per_token_loss = config.calculate_per_token_loss, per_token
        sink: list[tuple[float, int]] | None = [] if routing else None
        try:
            store = self._run(microbatches, loss_fn, False, sink)
        finally:
            config.calculate_per_token_loss = saved
        if sink is not None:
            self._routing_totals(sink)
        for hook in self.before_step:
            hook()
        grad_norm = guarded_step(optimizer, store, self.guard,  # NaN: update skipped / undone
                                 model_params=ddp.module.parameters())
        metrics = average_metrics(store)
        if self.stage is not None:  # the loss ran on the last stage
            metrics = metrics_from_last(self.stage, metrics)
        if self.policy.groups is not None:
            metrics = _data_parallel_mean(metrics)
        return metrics, grad_norm

    def hf_tensors(self, views: bool = False, persistent: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` of the current weights. One process: no collectives;
        multi-rank: shards gathered over TP / EP, every rank must consume it in lockstep;
        pipeline parallel: the whole model on rank 0 only, each stage streaming its own
        tensors there (``rl.pipeline.stream_to_main``). ``views``: the parameters' own memory
        where a tensor is a view of it (``iter_hf_tensors(copy=False)``): for a consumer that
        reads each tensor before the next optimizer step; ``persistent`` (with ``views``): the
        query / key / value from :attr:`stream_buffers`, for a consumer that holds the tensors
        across streams."""
        from megatron_qrl.models.streaming import iter_hf_tensors

        local = iter_hf_tensors(self.module, self.policy.arch, self.policy.groups,
                                copy=not views,
                                buffers=self.stream_buffers if views and persistent else None)
        return local if self.stage is None else stream_to_main(self.stage, local)

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state for a checkpoint (the distributed optimizer adds this
        rank's shard of the fp32 masters and Adam moments under ``optimizer_shards``)."""
        optimizer = self.policy.optimizer
        out = {"model": {k: v.detach().clone() for k, v in self.module.state_dict().items()
                         if v is not None and torch.is_tensor(v)},
               "optimizer": optimizer.state_dict()}
        if self.policy.options.distributed_optimizer:
            out["optimizer_shards"] = [_shard_state(o) for o in _members(optimizer)]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (exactly: parameters, Adam moments and step counts)."""
        missing, unexpected = self.module.load_state_dict(state["model"], strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        optimizer = self.policy.optimizer
        optimizer.load_state_dict(state["optimizer"])
        shards = state.get("optimizer_shards")
        if self.policy.options.distributed_optimizer:
            if shards is None:
                raise ValueError("the checkpoint was written without --use-distributed-optimizer;"
                                 " resume with the flags it was written with")
            with torch.no_grad():  # copies into the fp32 master parameters
                for o, shard in zip(_members(optimizer), shards, strict=True):
                    _unshare_adam_steps(o)
                    o.load_parameter_state_from_dp_reshardable(shard)
        self.policy.plan.weights_changed()


def _shard_state(optimizer: Any) -> dict:
    """A copy of this rank's shard of a ``DistributedOptimizer`` (masters, Adam moments) in
    megatron-core's "dp_reshardable" layout. megatron-core 0.16.1's getter returns live
    tensors and leaves out the ``padding`` entry its loader reads; both are added here."""
    state = optimizer.get_parameter_state_dp_reshardable()
    for key, by_dtype in state.items():
        if not isinstance(key, int):
            continue
        for buckets in by_dtype.values():
            for bucket in buckets:
                for i, elem in enumerate(bucket):
                    bucket[i] = {k: v.detach().clone() if torch.is_tensor(v) else v
                                 for k, v in elem.items()}
                    bucket[i].setdefault("padding", False)
    return state


def _unshare_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own Adam ``step`` tensor.

    megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict`` on the torch-Adam path
    (no TE / Apex: a CPU host) stores ONE step tensor in every parameter's state; torch's Adam
    increments each parameter's step in place, so the shared counter would advance once per
    parameter per update and the bias correction after a resume would be wrong (found by
    tests/rl/test_trainer_memory_flags.py::test_distributed_optimizer_resumes)."""
    inner = getattr(optimizer, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if torch.is_tensor(step):
            state["step"] = step.clone()


def _members(optimizer: Any) -> list:
    """The optimizers of a megatron ``ChainedOptimizer`` (EP > 1), or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def average_metrics(store: Sequence[dict]) -> dict[str, float]:
    """Mean (max for ``*_max`` keys) over micro batches of each scalar metric. The tensors
    are read in one host copy per device (not one wait per metric and micro batch)."""
    pairs = [(k, v) for d in store for k, v in d.items()
             if (torch.is_tensor(v) and v.numel() == 1) or isinstance(v, (int, float))]
    keys = [k for k, _ in pairs]
    values = host_scalars([v for _, v in pairs])
    sums: dict[str, list[float]] = {}
    for k, v in zip(keys, values):
        sums.setdefault(k, []).append(float(v))
    return {k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in sums.items()}


def _data_parallel_mean(metrics: dict[str, float]) -> dict[str, float]:
    """:func:`average_metrics` over every data-parallel rank's (equally many) micro batches."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return metrics
    keys = sorted(metrics)
    means = torch.tensor([metrics[k] for k in keys if not k.endswith("_max")], dtype=torch.float64)
    maxes = torch.tensor([metrics[k] for k in keys if k.endswith("_max")], dtype=torch.float64)
    dist.all_reduce(means, group=group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    out = dict(zip([k for k in keys if not k.endswith("_max")], (means / size).tolist()))
    out.update(zip([k for k in keys if k.endswith("_max")], maxes.tolist()))
    return out
