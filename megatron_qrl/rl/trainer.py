"""The trainer side of the RL loop: a megatron-core GPTModel, its DDP wrapper and optimizer.

:func:`build_policy` is the ONE place the policy model is built; the rollout-aligned forward
and routing replay plug in through its :class:`~megatron_qrl.rl.forward.ForwardPlan` (spec
hook, config overrides, aligned-forward state, ``moe.RoutingReplay``).

Every forward / backward goes through megatron-core's ``get_forward_backward_func()``:
- :meth:`PolicyTrainer.log_probs`: forward only, ``collect_non_loss_data=True``; the loss
  function returns the per-token log-probs (pi_prox recompute);
- :meth:`PolicyTrainer.train_step`: forward + backward over micro batches and one optimizer
  step (the policy loss through the losses' Megatron adapter, or the SFT loss).

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

    def new_optimizer(self, lr: float) -> Any:
        """A fresh optimizer (new moments) at ``lr`` of the same precision."""
        return make_optimizer(self.ddp, lr, bf16=self.bf16)

    def set_optimizer(self, optimizer: Any) -> None:
        """Use ``optimizer`` from now on (the aligned-forward cache follows its steps)."""
        self.optimizer = optimizer
        self.plan.attach(optimizer)  # a ChainedOptimizer (EP > 1) hooks each of its members


def build_policy(arch: ModelArch, lr: float, plan: ForwardPlan | None = None,
                 clip_grad: float = 1.0, weight_decay: float = 0.0, layout: Any = None,
                 groups: Any = None, bf16: bool = False) -> PolicyModel:
    """Build the policy (fp32 masters), wrap it in megatron DDP and make an Adam optimizer.

    ``plan.spec_hook`` maps the decoder layer ModuleSpec (aligned linears, replay routers);
    ``plan.config_overrides`` go to the ``TransformerConfig``. ``layout``: the
    ``models.builder.ParallelLayout`` of a multi-rank job (megatron's ``parallel_state`` must
    match it) and ``groups`` its ``models.streaming.ShardGroups``; None: one process.
    ``bf16``: BF16 parameters, fp32 gradient reduction and fp32 master weights in Adam.
    """
    plan = plan or ForwardPlan()
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_qrl.models.runtime import build_model

    dtype = torch.bfloat16 if bf16 else torch.float32
    model = build_model(arch, layout, dtype, spec_hook=plan.spec_hook, **plan.config_overrides)
    if plan.prepare_model is not None:
        plan.prepare_model(model)
    config = model.config
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True) if bf16
        else DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    policy = PolicyModel(ddp, None, config, arch, plan, groups, bf16)
    policy.set_optimizer(make_optimizer(ddp, lr, clip_grad, weight_decay, bf16))
    return policy


def make_optimizer(ddp: Any, lr: float, clip_grad: float = 1.0, weight_decay: float = 0.0,
                   bf16: bool = False) -> Any:
    """A fresh megatron-core Adam optimizer over ``ddp`` (new moments; used per phase);
    ``bf16``: the mixed-precision optimizer (fp32 master copies of the BF16 parameters)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    extra: dict[str, Any] = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, clip_grad=clip_grad, weight_decay=weight_decay,
                        adam_beta2=0.99, **extra), [ddp])


def set_lr(optimizer: Any, lr: float) -> None:
    """Set the learning rate of every parameter group of a megatron optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def _replay_ids(batch: dict) -> torch.Tensor | None:
    """The rollout's experts in megatron token order; positions the engine never routed
    (padding, the last sampled token: -1) get expert 0 — their logits are never in the loss."""
    from megatron_qrl.moe import tokens_from_batch

    ids = batch.get("routed_experts")
    return None if ids is None else tokens_from_batch(ids.clamp_min(0))


def _routing_counts(replay: Any, batch: dict) -> tuple[float, int] | None:
    """``(sum of per-token agreement, tokens)`` of the last forward against the engine's
    routing (moe.routing_agreement averaged over MoE layers; tokens the engine never routed,
    marked -1, are left out). None when the rollout carries no routing. Under sequence
    parallelism this rank's routers saw its TP rank's slice of the (sequence-major) tokens:
    the counts are of that slice (:meth:`PolicyTrainer.log_probs` sums them over TP)."""
    from megatron_qrl.moe import recorded_ids, routing_agreement, tokens_from_batch

    ids = batch.get("routed_experts")
    if ids is None:
        return None
    rollout = tokens_from_batch(ids)
    own = recorded_ids(replay, rollout.shape[1]).to(rollout.device)
    if own.shape[1:] == rollout.shape[1:] and own.shape[0] < rollout.shape[0]:
        from megatron.core import parallel_state as ps

        n, rank = own.shape[0], ps.get_tensor_model_parallel_rank()
        if n * ps.get_tensor_model_parallel_world_size() == rollout.shape[0]:
            rollout = rollout[rank * n:(rank + 1) * n]
    if own.shape != rollout.shape:
        return None
    keep = (rollout >= 0).flatten(1).all(1)
    n = int(keep.sum())
    if n == 0:
        return 0.0, 0
    return float(routing_agreement(own[keep], rollout[keep]).mean()) * n, n


def _forward_step(data_iterator, model, *, loss_fn: Callable, replay: Any,
                  routing_sink: list | None = None):
    batch = next(data_iterator)
    device = next(model.parameters()).device
    if device.type != "cpu":  # batches are built on the host; the GPU trainer reads them there
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                 for k, v in batch.items()}
    if replay is not None:
        replay.set_micro_batch(_replay_ids(batch))
    logits = model(batch["tokens"], batch["position_ids"], None)
    if routing_sink is not None and replay is not None:
        counts = _routing_counts(replay, batch)
        if counts is not None:
            routing_sink.append(counts)
    return logits, partial(loss_fn, batch)


class PolicyTrainer:
    """Forward-only log-probs and optimizer steps of one :class:`PolicyModel`."""

    def __init__(self, policy: PolicyModel) -> None:
        self.policy = policy
        self.last_routing_agreement: float | None = None
        """Mean over MoE layers of the fraction of (token, expert) choices of the last
        :meth:`log_probs` (pi_prox recompute) where the trainer's own top-k equals the
        engine's routed experts; None for dense models or rollouts without routing."""

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (no DDP wrapper)."""
        return self.policy.ddp.module

    def _run(self, microbatches: Sequence[dict], loss_fn: Callable, forward_only: bool,
             routing_sink: list | None = None) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not microbatches:
            raise ValueError("PolicyTrainer: no micro batches given")
        b, s = microbatches[0]["tokens"].shape
        replay = self.policy.plan.replay
        ctx = replay.use(None, "recompute" if forward_only else "update") \
            if replay is not None else contextlib.nullcontext()
        with ctx:
            return get_forward_backward_func()(
                forward_step_func=partial(_forward_step, loss_fn=loss_fn, replay=replay,
                                          routing_sink=routing_sink),
                data_iterator=iter(microbatches), model=[self.policy.ddp],
                num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
                forward_only=forward_only, collect_non_loss_data=forward_only)

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
        agree, tokens = sum(a for a, _ in sink), sum(n for _, n in sink)
        if self.policy.groups is not None:  # multi-rank: sum over token slices / DP shares
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            both = torch.tensor([float(agree), float(tokens), float(bool(sink))],
                                dtype=torch.float64)
            if self.policy.config.sequence_parallel:  # each TP rank saw its token slice
                dist.all_reduce(both, group=ps.get_tensor_model_parallel_group())
            dist.all_reduce(both, group=ps.get_data_parallel_group())
            agree, tokens = float(both[0]), int(both[1])
        self.last_routing_agreement = agree / tokens if tokens else None
        return [d["log_probs"].float() for d in store]

    def train_step(self, microbatches: Sequence[dict], loss_fn: Callable
                   ) -> tuple[dict[str, float], float]:
        """Forward/backward over ``microbatches`` and one optimizer step.

        Returns the loss function's metrics averaged over micro batches and the grad norm.
        """
        ddp, optimizer = self.policy.ddp, self.policy.optimizer
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        store = self._run(microbatches, loss_fn, False)
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step failed (inf/nan gradients); lower "
                               "--qrl-lr / --qrl-sft-lr")
        metrics = average_metrics(store)
        if self.policy.groups is not None:
            metrics = _data_parallel_mean(metrics)
        return metrics, float(grad_norm if grad_norm is not None else 0.0)

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` of the current weights. One process: no collectives;
        multi-rank: shards gathered over TP / EP, every rank must consume it in lockstep."""
        from megatron_qrl.models.streaming import iter_hf_tensors

        return iter_hf_tensors(self.module, self.policy.arch, self.policy.groups)

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state for a checkpoint."""
        return {"model": {k: v.detach().clone() for k, v in self.module.state_dict().items()
                          if v is not None and torch.is_tensor(v)},
                "optimizer": self.policy.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (exactly: parameters, Adam moments and step counts)."""
        missing, unexpected = self.module.load_state_dict(state["model"], strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        self.policy.optimizer.load_state_dict(state["optimizer"])
        self.policy.plan.weights_changed()


def average_metrics(store: Sequence[dict]) -> dict[str, float]:
    """Mean (max for ``*_max`` keys) over micro batches of each scalar metric."""
    sums: dict[str, list[float]] = {}
    for d in store:
        for k, v in d.items():
            if torch.is_tensor(v) and v.numel() == 1:
                sums.setdefault(k, []).append(float(v))
            elif isinstance(v, (int, float)):
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
