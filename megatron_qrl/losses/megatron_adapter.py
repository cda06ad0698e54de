"""The one place the losses meet Megatron: a ``loss_func`` for megatron-core's schedules.

Use from a ``forward_step_func``::

    loss_fn = PolicyLossFunc(PolicyLossConfig(kind="acr"))
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch["tokens"], batch["position_ids"], None)   # no labels -> logits
        return logits, functools.partial(loss_fn, batch)

(:func:`policy_forward_step` is exactly that.) The logits are the model's output
``[batch, seq, vocab / TP]``; per-token log-probs of ``batch["labels"]`` and the entropy
metric come from one chunked pass over the vocab-parallel logits
(:func:`megatron_qrl.losses.logprobs.chunked_log_probs`: the full vocabulary is never
gathered, no fp32 copy of the whole logits is kept), then :func:`compute_policy_loss` runs
on them. ``PolicyLossFunc(chunked=False)`` is the earlier path (megatron-core's
``vocab_parallel_cross_entropy`` on a fp32 copy + a separate entropy pass), kept for
comparison (tests, bench/train_mfu.py).

Return format. megatron-core 0.16.1 ``schedules.forward_step_calc_loss`` accepts both:
- 3-tuple ``(loss, num_tokens, {name: value})``: the schedule divides ``loss`` by
  ``num_tokens`` (unless ``config.calculate_per_token_loss``, where ``finalize_model_grads``
  divides the grads by the global token count) and by ``num_microbatches``; we therefore
  return ``loss = aggregated_loss * num_tokens``, so both paths train on the aggregated loss
  (with ``calculate_per_token_loss`` and ``token_mean`` it is the exact global token mean).
- 2-tuple ``(loss, {name: value})`` (legacy): the schedule multiplies by the CP size and
  divides by ``num_microbatches``; we return the aggregated loss.
``return_num_tokens=None`` picks the 3-tuple when the installed schedule supports it.
Metric values are detached scalars (Megatron-LM's train loop averages them over
microbatches). With ``non_loss_data=True`` (forward-only with ``collect_non_loss_data``)
the call returns ``{"log_probs": [batch, seq]}`` — the trainer's recompute of pi_prox.

Batch keys: ``labels`` [B, S] (sampled token ids aligned with the logits), ``loss_mask``
[B, S], ``old_log_probs`` (pi_prox; None: this forward's own log-probs, detached),
``rollout_log_probs`` (pi_behav), ``advantages`` [B] or
[B, S], optionally ``ref_log_probs``; ``packing`` (a ``models.packing.Packing``) when the trainer
ran the micro batch packed (``--qrl-pack-sequences``): the logits are then the packed row
``[1, T, vocab / TP]``; log-probs and entropy are computed on it against the packed labels and
scattered back to ``[B, S]`` (:func:`batch_log_probs`), so everything after is unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_qrl.losses.config import PolicyLossConfig
from megatron_qrl.losses.error_tokens import ErrorTokenConfig, filter_error_tokens
from megatron_qrl.losses.logprobs import chunked_log_probs
from megatron_qrl.losses.policy import compute_policy_loss

REQUIRED_KEYS = ("labels", "loss_mask", "old_log_probs", "rollout_log_probs", "advantages")


def schedule_accepts_num_tokens() -> bool:
    """True when the installed megatron-core schedule accepts the 3-tuple loss_func output."""
    from megatron.core.pipeline_parallel import schedules

    fn = getattr(schedules, "forward_step_calc_loss", None) or schedules.forward_step
    return "len(outputs) == 3" in inspect.getsource(fn)


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def vocab_parallel_log_probs(logits: Tensor, labels: Tensor, temperature: float = 1.0,
                             group=None) -> Tensor:
    """``log softmax(logits / T)[labels]`` for vocab-parallel logits ``[..., vocab / TP]``
    (``group``: their tensor-parallel group, default megatron-core's), chunked over tokens
    (:func:`~megatron_qrl.losses.logprobs.chunked_log_probs`). The logits are not modified."""
    return chunked_log_probs(logits, labels, temperature, group or _tp_group())[0]


def megatron_log_probs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """The same through megatron-core's ``vocab_parallel_cross_entropy`` on a fp32 copy (the
    earlier path: the fp32 softmax of every position is kept for the backward). The logits
    tensor is not modified (the division makes a copy)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / temperature
    return -vocab_parallel_cross_entropy(scaled, labels)


@torch.no_grad()
def vocab_parallel_entropy(logits: Tensor, group, temperature: float = 1.0) -> Tensor:
    """Per-position entropy of vocab-parallel logits (metric only, no grad, no gather)."""
    z = logits.detach().float() / temperature
    zmax = z.max(dim=-1).values
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - zmax.unsqueeze(-1))
    sums = torch.stack([e.sum(-1), (e * z).sum(-1)])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    return torch.log(sums[0]) + zmax - sums[1] / sums[0]


def batch_log_probs(fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]],
                    logits: Tensor, batch: Mapping) -> tuple[Tensor, Tensor | None]:
    """``fn(logits, labels) -> (log-probs, entropy or None)`` in the batch's ``[B, S]`` layout.

    A packed forward (``batch["packing"]``, :class:`megatron_qrl.models.packing.Packing`) gave
    the logits of the packed row ``[1, T, vocab / TP]``: ``fn`` runs there on the packed labels
    and its per-token results are scattered back to ``[B, S]`` (zero where nothing ran; those
    positions are outside every loss mask)."""
    packing = batch.get("packing")
    if packing is None:
        return fn(logits, batch["labels"])
    lp, ent = fn(logits, packing.pack(batch["labels"]))
    return packing.unpack(lp), None if ent is None else packing.unpack(ent)


class PolicyLossFunc:
    """Megatron ``loss_func``: bind the batch with ``functools.partial(self, batch)``."""

    def __init__(
        self,
        cfg: PolicyLossConfig,
        error_tokens: ErrorTokenConfig | None = None,
        temperature: float = 1.0,
        return_num_tokens: bool | None = None,
        log_entropy: bool = True,
        tp_group=None,
        chunked: bool = True,
    ) -> None:
        """``tp_group``: the tensor-parallel group of the logits (default: megatron-core's).
        ``chunked``: log-probs and entropy in one chunked pass (False: the earlier
        megatron-core cross entropy + separate entropy; module docstring)."""
        if temperature <= 0:
            raise ValueError(f"PolicyLossFunc: temperature={temperature} must be > 0")
        self.cfg = cfg
        self.error_tokens = error_tokens
        self.temperature = temperature
        self.return_num_tokens = (
            schedule_accepts_num_tokens() if return_num_tokens is None else return_num_tokens
        )
        self.log_entropy = log_entropy
        self._tp_group = tp_group
        self.chunked = chunked

    def _group(self):
        if self._tp_group is None:
            self._tp_group = _tp_group()
        return self._tp_group

    def _log_probs(self, logits: Tensor, labels: Tensor, entropy: bool
                   ) -> tuple[Tensor, Tensor | None]:
        """``(log-probs of labels, entropy or None)`` of the vocab-parallel logits."""
        if self.chunked:
            return chunked_log_probs(logits, labels, self.temperature, self._group(), entropy)
        lp = megatron_log_probs(logits, labels, self.temperature)
        ent = vocab_parallel_entropy(logits, self._group(), self.temperature) if entropy \
            else None
        return lp, ent

    def __call__(
        self, batch: Mapping[str, Tensor], output_tensor: Tensor, non_loss_data: bool = False
    ):
        missing = [k for k in REQUIRED_KEYS if k not in batch]
        if missing and not non_loss_data:
            raise KeyError(f"PolicyLossFunc: batch lacks {missing}; it needs {REQUIRED_KEYS}")
        want_entropy = self.log_entropy and not non_loss_data
        log_probs, entropy = batch_log_probs(
            lambda x, labels: self._log_probs(x, labels, want_entropy), output_tensor, batch)
        if non_loss_data:
            return {"log_probs": log_probs.detach()}
        loss_mask = batch["loss_mask"].bool()
        # None: pi_prox is this very forward (the first update of an RL step, whose weights
        # are pi_prox's: rl.steps, --qrl-prox-from-first-update)
        old = batch["old_log_probs"]
        old = log_probs.detach() if old is None else old
        metrics: dict[str, Tensor] = {}
        if self.error_tokens is not None:
            loss_mask, metrics = filter_error_tokens(
                batch["labels"], old, batch["rollout_log_probs"], loss_mask, self.error_tokens,
            )  # fmt: skip
        loss, loss_metrics = compute_policy_loss(
            log_probs,
            old,
            batch["rollout_log_probs"],
            batch["advantages"],
            loss_mask,
            self.cfg,
            ref_log_probs=batch.get("ref_log_probs"),
            entropy=entropy,
        )
        metrics.update(loss_metrics)
        if not self.return_num_tokens:
            return loss, metrics
        num_tokens = loss_mask.sum().to(torch.int)
        return loss * num_tokens.clamp_min(1), num_tokens, metrics


def policy_forward_step(data_iterator, model, *, loss_fn: PolicyLossFunc):
    """A Megatron ``forward_step_func``; bind with ``partial(policy_forward_step, loss_fn=...)``.

    The batch needs ``tokens`` and ``position_ids`` (and optionally ``attention_mask``) besides
    the keys :class:`PolicyLossFunc` reads.
    """
    batch = next(data_iterator)
    logits = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
    return logits, partial(loss_fn, batch)
