"""Non-finite loss / gradient guard of the trainer's optimizer steps (``--qrl-max-bad-steps``).

Before megatron's optimizer applies an update, :func:`guarded_step` reads the loss metrics of
the micro batches and the gradient norm (``prepare_grads`` + ``get_grad_norm``, the first half
of megatron's own ``step``). A NaN / inf in either skips the update (the weights stay as they
were, so no broken weights ever reach the engine) and is counted by :class:`BadStepGuard`; the
step that makes the count exceed ``max_bad_steps`` raises :class:`BadStepsError` naming the
step and the metric, before the step's weight sync. Multi-rank: the decision is agreed over
every rank (a MAX all-reduce of the flag), so all ranks skip or step together.

A finite gradient can still give broken weights (``--qrl-lr 1e30``: Adam's first update is
``lr * sign(g)``). So the guard also checks the parameters the update produced
(:class:`PreStepState`): before the step it copies what the step changes (the model's
parameters, the optimizer's fp32 masters and its moments); after it, non-finite parameters or
a relative update ``||w' - w|| / ||w||`` above ``max_update_ratio`` (``--qrl-max-update-
ratio``; norms over every parameter of every rank) restore that copy and count the update as
skipped, like a non-finite gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["BadStepGuard", "BadStepsError", "PreStepState", "guarded_step", "host_scalars",
           "non_finite_loss"]


class BadStepsError(RuntimeError):
    """More non-finite steps than ``--qrl-max-bad-steps``; names the step and the metric."""


class BadStepGuard:
    """Counts steps whose update was skipped; stops the run past ``max_bad_steps``."""

    def __init__(self, max_bad_steps: int, log: Callable[[str], None] = print,
                 max_update_ratio: float = 10.0) -> None:
        self.max_bad_steps = max_bad_steps
        self.log = log
        self.max_update_ratio = max_update_ratio
        """An update whose norm exceeds this multiple of the weights' norm is undone (0: the
        parameters are not checked after a step, and nothing is copied before it)."""
        self.step = 0
        """The global step being run (the driver sets it)."""
        self.bad_steps = 0
        """Steps of this invocation with at least one skipped update."""
        self.skipped = 0
        """Updates skipped in the current step."""

    def begin(self, step: int) -> None:
        """A new step starts."""
        self.step, self.skipped = step, 0

    def skip(self, metric: str, value: float) -> None:
        """One update of the current step is skipped; raise past ``max_bad_steps``."""
        self.skipped += 1
        if self.skipped == 1:
            self.bad_steps += 1
        what = f"step {self.step}: {metric} is {value}"
        if self.bad_steps > self.max_bad_steps:
            raise BadStepsError(
                f"{what}; {self.bad_steps} bad steps exceed --qrl-max-bad-steps "
                f"{self.max_bad_steps}, the run stops (its weights are those before the bad "
                "updates; the last checkpoint is intact). Lower --qrl-lr / --qrl-sft-lr or "
                "check the data and --qrl-loss-* values")
        if self.skipped == 1:
            self.log(f"[qrl-train] {what}: optimizer update skipped ({self.bad_steps} of "
                     f"--qrl-max-bad-steps {self.max_bad_steps} bad steps)")

    def record(self, rec: dict[str, Any]) -> dict[str, Any]:
        """``rec`` with the counts added; a bad step's non-finite values become None."""
        out = dict(rec)
        if self.skipped:
            out = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                   for k, v in out.items()}
        out["bad_updates"] = self.skipped
        out["bad_steps_total"] = self.bad_steps
        return out


def host_scalars(values: Sequence[Any]) -> list[Any]:
    """``values`` with every one-element tensor as a Python float, read in one host copy per
    device (one wait, not one per tensor); float64 holds every float32 / integer value
    exactly, NaN and inf included. Other values are returned as they are."""
    out = list(values)
    on: dict[Any, list[int]] = {}
    for i, v in enumerate(out):
        if torch.is_tensor(v) and v.numel() == 1:
            on.setdefault(v.device, []).append(i)
    for idx in on.values():
        read = torch.stack([out[i].detach().reshape(()).double() for i in idx]).tolist()
        for i, x in zip(idx, read):
            out[i] = x
    return out


def non_finite_loss(store: Sequence[dict]) -> tuple[str, float] | None:
    """``(metric, value)`` of the first NaN / inf loss metric (``loss`` / ``*_loss``) of the
    micro batches' metrics, or None. The tensors are read in one host copy per device."""
    found = [(k, v) for d in store for k, v in d.items() if k == "loss" or k.endswith("_loss")]
    for (k, _), x in zip(found, host_scalars([v for _, v in found])):
        if isinstance(x, float) and not math.isfinite(x):
            return k, x
    return None


def _all_sum(values: list[float]) -> list[float]:
    """``values`` summed over every rank (as is in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    nccl = dist.get_backend() == "nccl"
    t = torch.tensor(values, dtype=torch.float64,
                     device=torch.cuda.current_device() if nccl else "cpu")
    dist.all_reduce(t)
    return t.tolist()


class PreStepState:
    """Copies of what one optimizer step changes: ``model_params``, and per member optimizer
    its parameters (fp32 masters, or the model's own) and their state (Adam moments, step).
    Memory: one more copy of the parameters and of the optimizer state."""

    def __init__(self, optimizer: Any, model_params: Iterable[torch.Tensor]) -> None:
        self.masters: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.states: list[tuple[Any, dict]] = []
        for opt in _members(optimizer):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            state = {p: {k: v.detach().clone() if torch.is_tensor(v) else v
                         for k, v in inner.state[p].items()} for p in list(inner.state)}
            self.states.append((inner, state))
            self.masters += [(p, p.detach().clone()) for g in inner.param_groups
                             for p in g["params"]]
        seen = {id(p) for p, _ in self.masters}  # fp32 optimizers step the model's own
        self.model = [(p, p.detach().clone()) for p in model_params
                      if p.requires_grad and id(p) not in seen]

    def update_problem(self, max_ratio: float) -> tuple[str, float] | None:
        """``(what, value)`` when the step produced non-finite parameters or a relative
        update norm above ``max_ratio``; None when the update is sound (every rank agrees)."""
        bad = upd = old = 0.0
        for p, before in self.masters or self.model:
            new = p.detach().float()
            finite = torch.isfinite(new)
            bad += float((~finite).sum())
            upd += float((new - before.float()).where(finite, 0.0).double().pow(2).sum())
            old += float(before.double().pow(2).sum())
        bad, upd, old = _all_sum([bad, upd, old])
        if bad:
            return "the updated parameters (non-finite)", math.nan
        ratio = math.sqrt(upd) / max(math.sqrt(old), 1e-12)
        if not math.isfinite(ratio) or ratio > max_ratio:
            return (f"the update norm / weight norm (above --qrl-max-update-ratio "
                    f"{max_ratio:g})"), ratio
        return None

    @torch.no_grad()
    def restore(self) -> None:
        """Put the parameters and the optimizer state back as they were before the step."""
        for p, before in self.model + self.masters:
            p.copy_(before)
        for inner, state in self.states:
            inner.state.clear()
            for p, st in state.items():
                inner.state[p] = {k: v.clone() if torch.is_tensor(v) else v
                                  for k, v in st.items()}


def _agree(bad: bool) -> bool:
    """True on every rank when any rank is bad (no collective in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bad
    nccl = dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
    flag = torch.tensor([float(bad)], device=torch.cuda.current_device() if nccl else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _members(optimizer: Any) -> list[Any]:
    """The optimizers of a megatron ``ChainedOptimizer``, or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _clip_and_step(optimizer: Any, grad_norm: float) -> bool:
    """The second half of megatron-core 0.16.1's ``optimizer.step()`` (``MixedPrecision`` /
    ``FP32`` / ``ChainedOptimizer.step``: clip by the total norm, count zeros if configured,
    ``step_with_ready_grads``) with the norm the guard computed already, so the gradients are
    read once. Same clipping as megatron's (``clip_grad_by_total_norm_fp32`` per member with
    ``clip_grad > 0``), so the update is bit-identical."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in _members(optimizer):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(
                params, opt.config.clip_grad, grad_norm,
                opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    if optimizer.config.log_num_zeros_in_grad:
        optimizer.count_zeros()
    return bool(optimizer.step_with_ready_grads())


def guarded_step(optimizer: Any, store: Sequence[dict], guard: BadStepGuard | None,
                 model_params: Iterable[torch.Tensor] = ()) -> float:
    """Megatron's ``optimizer.step()`` and its gradient norm, unless ``guard`` is given and
    the loss or the gradient norm is non-finite: then the update is skipped, ``guard`` counts
    it and the norm is NaN. One gradient-norm pass either way: with a guard, the norm it
    checks is the one the clipping uses (:func:`_clip_and_step`). With a guard whose
    ``max_update_ratio`` > 0, the parameters the step produced are checked too
    (:class:`PreStepState`, ``model_params``: the model's parameters): a broken update is
    undone and counted like a skipped one."""
    if guard is None:
        ok, grad_norm, _ = optimizer.step()
    else:
        bad = non_finite_loss(store)
        found_inf = optimizer.prepare_grads()  # a grad scaler found inf (megatron's own check)
        if found_inf:
            bad = bad or ("gradient (grad scaler)", math.inf)
        grad_norm = 0.0 if found_inf else optimizer.get_grad_norm()
        norm = float(grad_norm or 0.0)
        if bad is None and not math.isfinite(norm):
            bad = ("grad_norm", norm)
        if _agree(bad is not None):
            guard.skip(*(bad or ("grad_norm (on another rank)", math.nan)))
            return math.nan
        before = PreStepState(optimizer, model_params) if guard.max_update_ratio > 0 else None
        ok = _clip_and_step(optimizer, grad_norm)
        problem = before.update_problem(guard.max_update_ratio) if before is not None else None
        if problem is not None:
            before.restore()
            guard.skip(*problem)
            return math.nan
    if not ok:
        raise RuntimeError("megatron optimizer step failed (inf/nan gradients); lower "
                           "--qrl-lr / --qrl-sft-lr")
    return float(grad_norm if grad_norm is not None else 0.0)
