"""A finished run's weights as HF tensors, rebuilt from its driver checkpoint.

LoRA runs: ``W + (alpha/r) B A`` for every adapted projection (LoRA, Hu et al. 2021, eq. 3;
product in fp32) over the frozen base as the trainer held it (NF4 / rollout-format bases
dequantized), from the run's model rebuilt with its stored flags (inside a one-rank Megatron
world, :func:`megatron_qrl.models.runtime.single_process_megatron`). Full-parameter runs: the
checkpoint's Megatron tensors mapped to HF names, no model built. Used by tools/merge_lora.py
and the rlquant compare's evaluation (:mod:`megatron_qrl.rl.compare_rlquant`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_qrl.config.configs import QrlConfigs

__all__ = ["configs_from_flags", "final_hf_tensors", "merged_lora_tensors"]


def configs_from_flags(flags: dict) -> QrlConfigs:
    """The run's component configs from the flag values stored in its checkpoint."""
    import argparse

    from megatron_qrl.config import add_qrl_args, qrl_configs_from_args

    parser = argparse.ArgumentParser()
    add_qrl_args(parser)
    args = parser.parse_args([])
    for k, v in flags.items():
        if hasattr(args, k):
            setattr(args, k, v)
    args.qrl_preset = None  # the stored values are already the effective ones
    return qrl_configs_from_args(args)


def merged_lora_tensors(state: dict, configs: QrlConfigs, data: Any, path: Path
                        ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """``(merged HF stream, PEFT adapters)`` of LoRA checkpoint ``state`` (read from ``path``);
    call inside a Megatron world of one rank."""
    from megatron_qrl.models.lora_io import adapter_tensors, base_hf_tensors, merge_into
    from megatron_qrl.rl.checkpoint import model_state_of
    from megatron_qrl.rl.forward import forward_plan
    from megatron_qrl.rl.lora_sync import enter_lora
    from megatron_qrl.rl.trainer import PolicyTrainer, build_policy

    trainer = PolicyTrainer(build_policy(data.arch, 1e-4, forward_plan(configs, data.arch)))
    enter_lora(trainer, configs)
    model_state = model_state_of(state, path, data.arch)  # (a PP run's stages joined)
    if not any(".qrl_base." in k for k in model_state):
        raise ValueError(f"{path} was written before the RL phase (no frozen base); merge a "
                         "checkpoint of the LoRA phase")
    trainer.load_state_dict({"model": model_state,
                             "optimizer": trainer.policy.optimizer.state_dict()})
    adapters = dict(adapter_tensors(trainer.module, data.arch))
    merged = merge_into(base_hf_tensors(trainer.module, data.arch), adapters,
                        configs.lora.scaling)
    return merged, adapters


def final_hf_tensors(run_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """``(hf_config, {hf name: tensor}, configs)`` of the newest checkpoint of ``run_dir`` (a
    LoRA run merged: call inside a Megatron world of one rank)."""
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.models.streaming import iter_hf_tensors
    from megatron_qrl.rl.checkpoint import latest_checkpoint, model_state_of
    from megatron_qrl.rl.driver import prepare_job

    path = latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoints/step_*.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    configs = configs_from_flags(dict(state["flags"], qrl_task_prompts=None))
    cfg = state["model_config"]
    if configs.lora.enabled:
        merged, _ = merged_lora_tensors(state, configs, prepare_job(configs), path)
        return cfg, dict(merged), configs
    arch = arch_from_dict(cfg)
    named = model_state_of(state, path, arch).items()
    return cfg, dict(iter_hf_tensors(None, arch, named=named)), configs
