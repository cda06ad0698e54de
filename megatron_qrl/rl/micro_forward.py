"""One micro batch's forward for megatron-core's schedule (the trainer's ``forward_step_func``).

:func:`forward_step` takes the next micro batch (built on the host, ``rl/batch.py`` layout
``[B, S]``), moves it to the model's device, sets the routing-replay ids and the KV-cache
alignment's prompt lengths, runs the model and returns the logits with the loss function bound
to the batch.

Padded (the default): the model runs ``[B, S]`` tokens. Packed (``--qrl-pack-sequences``,
``pack`` = the multiple the packed length is padded to): each row's first
``rl.microbatch.row_lengths`` tokens (one past its last loss position: later positions feed no
logit in any loss under the causal mask) go back to back into one row ``[1, T]`` with position
ids restarting per sample and megatron-core's ``PackedSeqParams`` (THD, ``cu_seqlens``) — no
padding runs through the layers (:mod:`megatron_qrl.models.packing`). The loss function gets
the ``[B, S]`` batch plus its ``packing`` and maps the packed logits' log-probs back
(``losses.megatron_adapter.batch_log_probs``), so losses and recomputed log-probs keep the
per-sample layout. Routing replay reads the packed row's experts; the KV-cache-aligned core
attention cannot take packed sequences (refused by ``config.checks`` and here).

megatron-core's all-gather MoE token dispatcher (the local spec's; LoRA and CPU builds) gathers
equal-sized token blocks over the tensor x expert parallel ranks; with EP > 1 those include
data-parallel ranks holding other samples, so the packed length is the maximum over that group
(:func:`pack_group`; a longer tail segment on the shorter rows) — padded micro batches share
one ``[B, S]`` already.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

__all__ = ["forward_step", "pack_group", "pack_multiple", "positions_run", "replay_ids",
           "routing_counts"]


def pack_multiple(config: Any) -> int:
    """What the packed length must be a multiple of: the TP size under sequence parallelism
    (megatron scatters the sequence dimension over the TP ranks), else 1."""
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def pack_group(config: Any) -> Any:
    """The process group whose packed lengths must be equal (module docstring): the tensor x
    expert parallel group of a MoE under the all-gather dispatcher with EP > 1, else None."""
    if not getattr(config, "num_moe_experts", None) or config.expert_model_parallel_size < 2 \
            or config.moe_token_dispatcher_type != "allgather":
        return None
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_and_model_parallel_group()


def _group_length(lengths: list[int], pack: int, group: Any, device: Any) -> int:
    """The packed length over ``group``: its ranks' longest (one small all-reduce)."""
    real = sum(lengths)
    t = torch.tensor([real + (-real % pack)], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(t.item())


def positions_run(mb: dict, pack: int | None = None) -> int:
    """Token positions the model runs for micro batch ``mb``: ``B x S`` padded, the packed
    length (the tail to a multiple of ``pack`` included) when packed."""
    if pack is None:
        return int(mb["tokens"].numel())
    from megatron_qrl.rl.microbatch import row_lengths

    real = int(row_lengths(mb).sum())
    return real + (-real % pack)


def _packed(batch: dict, lengths: list[int], pack: int, at_least: int = 0) -> tuple[dict, Any]:
    """``(model inputs of the packed row, Packing)`` of a ``[B, S]`` batch on its device."""
    from megatron_qrl.models.packing import Packing

    tokens = batch["tokens"]
    packing = Packing.of_lengths(lengths, tokens.shape[1], pack, device=tokens.device,
                                 at_least=at_least)
    inputs = {"tokens": packing.pack(tokens), "position_ids": packing.position_ids(),
              "packed_seq_params": packing.seq_params()}
    if batch.get("routed_experts") is not None:
        inputs["routed_experts"] = packing.pack(batch["routed_experts"], fill=-1)
    return inputs, packing


def replay_ids(batch: dict) -> torch.Tensor | None:
    """The rollout's experts in megatron token order; positions the engine never routed
    (padding, the last sampled token: -1) get expert 0 — their logits are never in the loss."""
    from megatron_qrl.moe import tokens_from_batch

    ids = batch.get("routed_experts")
    return None if ids is None else tokens_from_batch(ids.clamp_min(0))


def routing_counts(replay: Any, batch: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(sum of per-token agreement, tokens)`` of the last forward against the engine's
    routing, as two 0-dim device tensors (no host read: the trainer sums them over the step's
    micro batches and reads them once, ``PolicyTrainer._routing_totals``). A token's agreement
    is ``moe.routing_agreement``'s fraction averaged over the MoE layers (under pipeline
    parallelism: over this stage's); tokens the engine never routed, marked -1, are left out.
    None when the rollout carries no routing. Under sequence parallelism this rank's routers
    saw its TP rank's slice of the (sequence-major) tokens: the counts are of that slice
    (``PolicyTrainer.log_probs`` sums them over TP)."""
    from megatron_qrl.moe import recorded_ids, tokens_from_batch

    ids = batch.get("routed_experts")
    if ids is None:
        return None
    rollout = tokens_from_batch(ids)
    layers = sorted(replay.recorded)  # this pipeline stage's MoE layers (all without PP)
    if layers and layers != list(range(rollout.shape[1])):
        rollout = rollout[:, layers]
        own = torch.stack([replay.recorded[i] for i in layers], dim=1).to(rollout.device)
    else:
        own = recorded_ids(replay, rollout.shape[1]).to(rollout.device)
    if own.shape[1:] == rollout.shape[1:] and own.shape[0] < rollout.shape[0]:
        from megatron.core import parallel_state as ps

        n, rank = own.shape[0], ps.get_tensor_model_parallel_rank()
        if n * ps.get_tensor_model_parallel_world_size() == rollout.shape[0]:
            rollout = rollout[rank * n:(rank + 1) * n]
    if own.shape != rollout.shape:
        return None
    keep = (rollout >= 0).flatten(1).all(1)
    match = (own.unsqueeze(-1) == rollout.unsqueeze(-2)).any(-1)  # [tokens, layers, top_k]
    per_token = match.float().mean(dim=(1, 2))
    return (per_token * keep).sum(), keep.sum()


def forward_step(data_iterator, model, *, loss_fn: Callable, replay: Any,
                 routing_sink: list | None = None, kv: Any = None, pack: int | None = None,
                 group: Any = None):
    """megatron-core ``forward_step_func`` (module docstring); ``pack``: None = padded, else
    the packed length's multiple (:func:`pack_multiple`); ``group``: :func:`pack_group`."""
    batch = next(data_iterator)
    lengths = None
    if pack is not None:
        if kv is not None:
            raise ValueError("--qrl-pack-sequences: the KV-cache-aligned core attention "
                             "(--qrl-train-forward aligned with --qrl-rollout-kv-cache) cannot "
                             "take packed sequences; drop one of them")
        from megatron_qrl.rl.microbatch import row_lengths

        lengths = row_lengths(batch).tolist()  # on the host: no device sync
    device = next(model.parameters()).device
    if device.type != "cpu":  # batches are built on the host; the GPU trainer reads them there
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                 for k, v in batch.items()}
    inputs, extra = batch, {}
    if lengths is not None:
        at_least = 0 if group is None else _group_length(lengths, pack, group, device)
        inputs, packing = _packed(batch, lengths, pack, at_least)
        batch = {**batch, "packing": packing}
        extra = {"packed_seq_params": inputs["packed_seq_params"]}
    if replay is not None:
        replay.set_micro_batch(replay_ids(inputs))
    if kv is not None:  # KV-cache alignment: each sample's prompt positions read fresh K/V
        kv.set_micro_batch(batch["loss_mask"])
    logits = model(inputs["tokens"], inputs["position_ids"], None, **extra)
    if routing_sink is not None and replay is not None:
        counts = routing_counts(replay, inputs)
        if counts is not None:
            routing_sink.append(counts)
    return logits, partial(loss_fn, batch)
