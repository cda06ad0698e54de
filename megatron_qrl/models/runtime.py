"""Run megatron-core in ONE process (the conversion tools) and build models in it."""

from __future__ import annotations

import contextlib
import datetime
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

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
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(minutes=30))
        parallel_state.initialize_model_parallel()
        mode = contextlib.nullcontext()
    try:
        with mode:
            yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build_model(arch: ModelArch, layout: ParallelLayout | None = None,
                params_dtype: torch.dtype = torch.float32, spec_hook: SpecHook | None = None,
                pg_collection: Any = None, **overrides: Any) -> torch.nn.Module:
    """``config_and_spec`` + ``build_gpt_model`` (call inside an initialised megatron job)."""
    if arch.is_moe and not use_transformer_engine():
        from megatron_qrl.compat.moe_cpu import enable_moe_router_without_te
        enable_moe_router_without_te()
    config, spec = config_and_spec(arch, layout, params_dtype, spec_hook=spec_hook, **overrides)
    return build_gpt_model(arch, config, spec, pg_collection=pg_collection)


_EXPERT_PARAM = re.compile(r"\.mlp\.experts\.")


def meta_parameter_counts(arch: ModelArch) -> tuple[int, int]:
    """``(total, active)`` parameters of the Megatron model of ``arch`` built on the meta device.

    No memory is allocated for weights. Active counts ``moe_top_k`` of ``num_experts`` experts.
    Call inside :func:`single_process_megatron` (or any TP = EP = 1 job).
    """
    with torch.device("meta"):
        model = build_model(arch, perform_initialization=False, use_cpu_initialization=True)
    total = expert = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if _EXPERT_PARAM.search(name):
            expert += param.numel()
    active = total - expert + (expert * arch.moe_top_k // arch.num_experts if arch.is_moe else 0)
    return total, active
