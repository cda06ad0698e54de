"""Pipeline parallelism in the trainer: what megatron-core's schedule leaves to its caller.

With ``--pipeline-model-parallel-size`` P > 1 megatron-core's ``get_forward_backward_func()``
is the 1F1B schedule (``forward_backward_pipelining_without_interleaving``): every stage runs
the same ``forward_step_func`` on the same micro batches in order (every rank holds the whole
rollout batch: it is broadcast from rank 0 before the step), activations travel stage to
stage, and the loss function runs on the last stage only. The schedule sends activations of
ONE shape, ``[S (/ TP under sequence parallelism), B, hidden]`` from its ``seq_length`` and
``micro_batch_size`` arguments, so every micro batch of one call must have the same ``[B, S]``
(:func:`uniform_shape`): the padded micro batches of ``--qrl-micro-batch-size`` do (the
rollout batch is padded to its longest sample); packed rows, token-budget micro batches and
merged log-prob batches do not, and are refused under PP (:func:`pipeline_problem`).
megatron-core's ``variable_seq_lengths`` (shapes sent ahead of each activation) would lift
that, but 0.16.1 refuses it with the allgather MoE dispatcher of CPU / local-spec builds.

What lives on the last stage only and is broadcast over the pipeline group here: the
per-token log-probs of the pi_prox recompute (:func:`log_probs_from_last`) and the loss
metrics of an update (:func:`metrics_from_last`). Routing agreement is measured by each stage
on its own MoE layers and combined weighted by layer count (:func:`layer_weighted_sum`). The
weight sync (the LoRA sync's base, adapters and merged weights too, ``rl.lora_sync``) streams
each stage's own tensors to rank 0 one at a time (:func:`stream_to_main`), never gathering the
model on one rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_qrl.config.configs import QrlConfigs

__all__ = ["any_stage", "layer_weighted_sum", "log_probs_from_last", "metrics_from_last", "pipeline_problem",
           "stream_to_main", "uniform_shape"]


def pipeline_problem(configs: QrlConfigs, pp: int) -> str | None:
    """The ``--qrl-*`` flag that cannot run with ``--pipeline-model-parallel-size pp``, as
    one line naming it and the fix (None: none)."""
    if pp <= 1:
        return None
    run = configs.run
    uaq = configs.uaq
    if uaq is not None and uaq.enabled:
        return (f"--qrl-uaq-scale {uaq.scale} with --pipeline-model-parallel-size {pp}: UAQ at "
                "the start of RL reads every layer of the model on one rank; fold it into the "
                "checkpoint instead (tools/convert_hf_to_megatron.py --uaq-scale, then --load "
                "the result) and drop --qrl-uaq-scale")
    why = ("each micro batch a shape of its own; megatron-core's pipeline schedule sends "
           "activations of one shape")
    for flag, on in (("--qrl-pack-sequences", run.pack_sequences),
                     ("--qrl-max-tokens-per-micro-batch", run.max_tokens_per_micro_batch),
                     ("--qrl-log-prob-max-tokens", run.log_prob_max_tokens)):
        if on:
            return (f"{flag} with --pipeline-model-parallel-size {pp}: {why}; drop {flag} "
                    "(padded micro batches of --qrl-micro-batch-size)")
    return None


def uniform_shape(microbatches: Sequence[dict]) -> tuple[int, int]:
    """``(B, S)`` shared by every micro batch of one pipelined schedule call (module
    docstring); raises naming the shapes otherwise."""
    shapes = {tuple(mb["tokens"].shape) for mb in microbatches}
    if len(shapes) != 1:
        raise ValueError(f"pipeline parallel: micro batches of one step must share one [B, S] "
                         f"shape, got {sorted(shapes)}; use padded micro batches of "
                         "--qrl-micro-batch-size")
    (shape,) = shapes
    return shape[0], shape[1]


def _last_rank(stage: Any) -> int:
    """Global rank of the last stage in this rank's pipeline group."""
    return dist.get_global_rank(stage.group, stage.size - 1)


def log_probs_from_last(stage: Any, store: list, microbatches: Sequence[dict]
                        ) -> list[torch.Tensor]:
    """The last stage's per-token log-probs (``store`` of a forward-only schedule with
    ``collect_non_loss_data``) on every stage: one broadcast of ``[n, B, S]`` fp32."""
    b, s = uniform_shape(microbatches)
    if stage.last:
        flat = torch.stack([d["log_probs"].float() for d in store]).to(_device())
    else:
        flat = torch.empty(len(microbatches), b, s, dtype=torch.float32, device=_device())
    dist.broadcast(flat, src=_last_rank(stage), group=stage.group)
    return list(flat.unbind(0))


def _device() -> torch.device:
    """Where collectives of the trainer's backend take tensors (NCCL: the current GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def metrics_from_last(stage: Any, metrics: dict[str, float]) -> dict[str, float]:
    """The last stage's averaged loss metrics on every stage of its pipeline group."""
    box = [metrics if stage.last else None]
    dist.broadcast_object_list(box, src=_last_rank(stage), group=stage.group)
    return box[0]


def any_stage(stage: Any, flag: bool) -> bool:
    """``flag`` of any stage of this rank's pipeline group (``flag`` itself without one)."""
    if stage is None:
        return flag
    box = torch.tensor([int(flag)], dtype=torch.int32, device=_device())
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=stage.group)
    return bool(box.item())


def layer_weighted_sum(stage: Any, values: torch.Tensor, layers: int) -> torch.Tensor:
    """``sum_stages(layers_s * values_s) / sum_stages(layers_s)`` over the pipeline group:
    per-stage means over ``layers`` MoE layers combined into the mean over all layers."""
    both = torch.cat([values.double() * layers, torch.tensor([float(layers)],
                                                              dtype=torch.float64)])
    both = both.to(_device())
    dist.all_reduce(both, group=stage.group)
    both = both.cpu()
    return both[:-1] / both[-1].clamp_min(1.0)


def _send(item: tuple[str, torch.Tensor] | None, dst: int, group: Any) -> None:
    header = None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)
    dist.send_object_list([header], dst=dst, group=group)
    if item is not None:
        dist.send(item[1].contiguous().to(_device()), dst=dst, group=group)


def _receive(src: int, group: Any) -> Iterator[tuple[str, torch.Tensor]]:
    while True:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, group=group)
        if box[0] is None:
            return
        name, shape, dtype = box[0]
        tensor = torch.empty(shape, dtype=dtype, device=_device())
        dist.recv(tensor, src=src, group=group)
        yield name, tensor


def stream_to_main(stage: Any, local: Iterator[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the whole model on global rank 0, one tensor at a time; on the
    other ranks nothing (collective: every rank must consume it).

    Each rank consumes ``local`` (its stage's tensors under their global names; the TP / EP
    gathers inside it stay within the stage, so every rank of a stage yields the same
    tensors). In rank 0's pipeline group, stage ``s > 0`` sends each to rank 0 point to
    point as it comes; rank 0 yields its own stage's,
    then each later stage's in order. Other data-parallel replicas only consume ``local``."""
    ranks = dist.get_process_group_ranks(stage.group)
    me = dist.get_rank()
    if me == 0:
        yield from local
        for src in ranks[1:]:
            yield from _receive(src, stage.group)
        return
    sender = ranks[0] == 0  # one rank per later stage: rank 0's pipeline group
    for item in local:
        if sender:
            _send(item, 0, stage.group)
    if sender:
        _send(None, 0, stage.group)

