"""Initialise and tear down torch.distributed + megatron-core ``parallel_state`` on gloo.

For tests and the CPU default job: one process per rank, a TCP rendezvous on
``127.0.0.1:port``, the gloo backend, then ``parallel_state.initialize_model_parallel`` and
megatron-core's model-parallel RNG seeding. Enables the CPU shim of
:mod:`megatron_qrl.compat.cpu` first, since megatron-core seeds the "CUDA" RNG here.
Tested with megatron-core 0.16.1.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_qrl.compat.cpu import enable_cpu_megatron
from megatron_qrl.utils.net import free_port  # noqa: F401  (re-exported: the tests' rendezvous port)


@dataclass(frozen=True)
class CpuParallelLayout:
    """What :func:`init_cpu_distributed` set up for this rank."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of processes."""
    tp: int
    """Tensor-model-parallel size."""
    pp: int
    """Pipeline-model-parallel size."""
    ep: int
    """Expert-model-parallel size."""


def init_cpu_distributed(
    rank: int,
    world_size: int,
    port: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    timeout_s: float = 300.0,
) -> CpuParallelLayout:
    """Join a gloo process group and initialise megatron-core model parallelism on CPU.

    Args:
        rank / world_size / port: this process, the group size and the rendezvous port
            (use :func:`free_port` or any free TCP port on 127.0.0.1).
        tp / pp / ep / etp: tensor / pipeline / expert / expert-tensor parallel sizes;
            ``world_size`` must be divisible by ``tp * pp`` (data parallel takes the rest).
        seed: passed to ``model_parallel_cuda_manual_seed`` (routed to the CPU generator).
        timeout_s: every collective's timeout, the default group's and megatron's groups'.
    """
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"init_cpu_distributed: world_size={world_size} is not divisible by tp*pp={tp * pp}; "
            "choose sizes whose product divides the number of processes."
        )
    from megatron.core import parallel_state, tensor_parallel

    enable_cpu_megatron()
    if not dist.is_initialized():
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_s / 60.0,  # megatron's groups: the same timeout
    )
    set_group_timeouts(timeout_s)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return CpuParallelLayout(rank=rank, world_size=world_size, tp=tp, pp=pp, ep=ep)


def set_group_timeouts(timeout_s: float) -> int:
    """Every process group this rank is in waits at most ``timeout_s`` per collective (a
    frozen peer then ends the job whichever group it was in); returns how many groups.
    megatron-core 0.16.1 creates its expert data-parallel gloo group without the
    ``distributed_timeout_minutes`` it is given (30 min, torch's default)."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    groups = [g for g in list(c10d._world.pg_map) if not c10d._rank_not_in_group(g)]
    for group in groups:
        c10d._set_pg_timeout(timeout, group)
    return len(groups)


def destroy_cpu_distributed() -> None:
    """Tear down megatron-core parallel state and the default process group (idempotent)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
