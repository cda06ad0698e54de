"""Tiny megatron-core GPT on CPU for tests: build, train a step, gather TP-sharded weights.

Call these inside a process that ran ``megatron_qrl.compat.init_cpu_distributed`` (see
``tests/helpers/mp_utils.run_distributed``) and inside ``cpu_device_mode()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 128
SEQ = 16


def build_tiny_gpt(
    tp: int = 1,
    vocab_size: int = VOCAB,
    seq_len: int = SEQ,
    lr: float = 1e-2,
    clip_grad: float = 1.0,
    **config_overrides: Any,
):
    """A 2-layer GPT (hidden 64, 4 heads / 2 query groups), DDP-wrapped, and its optimizer.

    Local spec, ``use_cpu_initialization=True``, ``add_bias_linear=False``, no dropout, fp32.
    Returns ``(ddp_model, optimizer, transformer_config)``.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
    )
    fields.update(config_overrides)
    config = TransformerConfig(**fields)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=seq_len,
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, clip_grad=clip_grad), [ddp]
    )
    return ddp, optimizer, config


def train_step(
    ddp,
    optimizer,
    forward_step_func: Callable,
    microbatches: Iterable[Any],
    num_microbatches: int,
    seq_len: int,
    micro_batch_size: int,
) -> tuple[list[dict[str, torch.Tensor]], float]:
    """One ``get_forward_backward_func()`` pass plus one optimizer step.

    Returns the schedule's ``forward_data_store`` (the loss_func metric dicts) and the grad
    norm reported by the optimizer.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    store = get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iter(microbatches),
        model=[ddp],
        num_microbatches=num_microbatches,
        seq_length=seq_len,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("megatron optimizer step reported failure (found inf/nan)")
    return store, float(grad_norm)


def gathered_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (TP-gathered) copies of every parameter, keyed by name; grads under ``name.grad``.

    Megatron's DDP accumulates into ``param.main_grad``; that is what is reported as grad.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_model_parallel_world_size()
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        name = name.removeprefix("module.")
        grad = getattr(param, "main_grad", None)
        for key, value in ((name, param), (name + ".grad", grad)):
            if value is None:
                continue
            value = value.detach().clone()
            if world > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(value) for _ in range(world)]
                dist.all_gather(parts, value.contiguous(), group=group)
                value = torch.cat(parts, dim=param.partition_dim)
            out[key] = value
    return out


def tiny_batches(n: int, batch: int = 2, seq_len: int = SEQ, vocab: int = VOCAB, seed: int = 0):
    """``n`` deterministic token batches ``[batch, seq_len]`` (identical on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq_len), generator=gen) for _ in range(n)]
