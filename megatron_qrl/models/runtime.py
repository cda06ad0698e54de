"""Run megatron-core in ONE process (the conversion tools) or in the ranks of a torchrun job.

:func:`single_process_megatron`: a world of one rank. :func:`torchrun_megatron`: the ranks
``torchrun`` started (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in the
environment) with a TP / EP layout; gloo + megatron's CPU shim on a CPU-only host, NCCL on GPUs.
:class:`RankWorld` is what a job needs to know about its rank (rank 0 owns the rollout engine
and the outputs) and its three collectives over all ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_qrl.compat.distributed import set_group_timeouts
from megatron_qrl.models.builder import (
    ParallelLayout,
    SpecHook,
    build_gpt_model,
    config_and_spec,
    use_transformer_engine,
)
from megatron_qrl.models.hf_config import ModelArch


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """A world of one rank (gloo) with TP = EP = 1; on a CPU-only host, megatron's CPU shim."""
    from megatron.core import parallel_state

    from megatron_qrl.compat.distributed import free_port

    if dist.is_initialized():
        raise RuntimeError("single_process_megatron(): torch.distributed is already initialised; "
                           "call the conversion functions directly inside your own job instead")
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from megatron_qrl.compat import cpu_device_mode, init_cpu_distributed
        init_cpu_distributed(0, 1, free_port())
        mode: Any = cpu_device_mode()
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(minutes=30))
        parallel_state.initialize_model_parallel()
        # TE layers initialise their weights under the model-parallel RNG tracker (the H200
        # run of tests/gpu/test_te_spec.py failed without it: "cuda rng state ... not added")
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        mode = contextlib.nullcontext()
    try:
        with mode:
            yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@dataclass(frozen=True)
class RankWorld:
    """This process's rank among ``world_size`` ranks that all train the same model."""

    rank: int = 0
    """Global rank (0 owns the rollout engine, progress bar, metrics, plots, checkpoints)."""
    world_size: int = 1
    """Number of ranks; 1 is the single-process job (no collectives at all)."""
    dp_rank: int = 0
    """Rank in megatron's (dense) data-parallel group."""
    dp_size: int = 1
    """Data-parallel size: ranks that train on different micro batches of one batch."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; tensors should be on the CPU)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def from_main(self, fn: Any) -> Any:
        """``fn()`` run on rank 0, its result on every rank."""
        return self.broadcast(fn() if self.is_main else None)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0, None on the others."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def local(self, microbatches: list, updates: int) -> list:
        """This data-parallel rank's share of ``microbatches``: each of the ``updates``
        consecutive chunks (one optimizer step each) is split into ``dp_size`` equal parts."""
        if self.dp_size == 1:
            return microbatches
        per_update = len(microbatches) // updates
        if per_update * updates != len(microbatches) or per_update % self.dp_size:
            raise ValueError(
                f"{len(microbatches)} micro batches do not split into {updates} optimizer "
                f"step(s) x {self.dp_size} data-parallel ranks; make the rollout batch "
                "(--qrl-prompts-per-step x --qrl-rollout-n-samples-per-prompt) a multiple of "
                "--qrl-micro-batch-size x --qrl-updates-per-step x the data-parallel size "
                "(ranks / (TP x PP))")
        k = per_update // self.dp_size
        return [mb for u in range(updates) for mb in
                microbatches[u * per_update + self.dp_rank * k:u * per_update + (self.dp_rank + 1) * k]]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def shard_groups(self, num_layers: int | None = None) -> Any:
        """The ``models.streaming.ShardGroups`` of this rank (None in one process);
        ``num_layers``: the model's decoder layers (pipeline stages' layer offsets)."""
        if self.world_size == 1:
            return None
        from megatron_qrl.models.streaming import groups_from_parallel_state

        return groups_from_parallel_state(num_layers)


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` of the environment (1 when not launched by torchrun)."""
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"WORLD_SIZE={value!r} in the environment is not a positive integer")
    return int(value)


@contextlib.contextmanager
def torchrun_megatron(tp: int = 1, ep: int = 1, etp: int = 1, pp: int = 1,
                      timeout_s: float = 1800.0) -> Iterator[RankWorld]:
    """Join the torchrun job of the environment and initialise megatron's TP / PP / EP groups.

    Needs ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun sets them;
    ``LOCAL_RANK`` picks the GPU). CPU-only host: gloo and megatron's CPU shim.
    """
    from megatron.core import parallel_state

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"torchrun_megatron(): {', '.join(missing)} not set; launch with "
                           "torchrun --nproc-per-node N")
    if dist.is_initialized():
        raise RuntimeError("torchrun_megatron(): torch.distributed is already initialised")
    rank, world = int(os.environ["RANK"]), torchrun_world_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                                timeout=timeout)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
            distributed_timeout_minutes=timeout_s / 60.0)
        set_group_timeouts(timeout_s)
        mode: Any = contextlib.nullcontext()
    else:
        from megatron_qrl.compat import cpu_device_mode, init_cpu_distributed
        from megatron_qrl.compat.cpu import enable_cpu_megatron

        enable_cpu_megatron()
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=timeout)
        init_cpu_distributed(rank, world, 0, tp=tp, pp=pp, ep=ep, etp=etp, timeout_s=timeout_s)
        mode = cpu_device_mode()
    try:
        with mode:
            yield RankWorld(rank, world, parallel_state.get_data_parallel_rank(),
                            parallel_state.get_data_parallel_world_size())
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build_model(arch: ModelArch, layout: ParallelLayout | None = None,
                params_dtype: torch.dtype = torch.float32, spec_hook: SpecHook | None = None,
                pg_collection: Any = None, use_te: bool | str | None = None,
                stage: Any = None, **overrides: Any) -> torch.nn.Module:
    """``config_and_spec`` + ``build_gpt_model`` (call inside an initialised megatron job).

    ``stage``: this rank's ``models.stages.PipelineStage`` under pipeline parallelism (its
    layers; the embedding on the first stage, the output layer on the last); None: all.

    ``use_te``: the layer implementation (``models.builder.TRANSFORMER_IMPLS`` or a bool;
    None = auto: the TE spec where TE imports and CUDA is present)."""
    if arch.is_moe and not use_transformer_engine():
        from megatron_qrl.compat.moe_cpu import enable_moe_router_without_te
        enable_moe_router_without_te()
    config, spec = config_and_spec(arch, layout, params_dtype, use_te=use_te,
                                   spec_hook=spec_hook, **overrides)
    first, last = (True, True) if stage is None else (stage.first, stage.last)
    return build_gpt_model(arch, config, spec, pg_collection=pg_collection, pre_process=first,
                           post_process=last)


_EXPERT_PARAM = re.compile(r"\.mlp\.experts\.")


def meta_parameter_counts(arch: ModelArch) -> tuple[int, int]:
    """``(total, active)`` parameters of the Megatron model of ``arch`` built on the meta device.

    No memory is allocated for weights. Active counts ``moe_top_k`` of ``num_experts`` experts.
    Call inside :func:`single_process_megatron` (or any TP = EP = 1 job).
    """
    with torch.device("meta"):
        # the local spec (same parameters as the TE spec): TE's linears under CPU
        # initialisation copy a CPU master weight into theirs, which fails on meta (H200, TE
        # 2.20.2: "Cannot copy out of meta tensor")
        model = build_model(arch, perform_initialization=False, use_cpu_initialization=True,
                            use_te=False)
    total = expert = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if _EXPERT_PARAM.search(name):
            expert += param.numel()
    active = total - expert + (expert * arch.moe_top_k // arch.num_experts if arch.is_moe else 0)
    return total, active
