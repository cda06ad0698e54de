"""The one rollout-engine factory: which engine a job gets, and building it.

:func:`engine_spec` makes the reference-or-SGLang choice from ``--qrl-rollout-engine`` once,
as a picklable :class:`~megatron_qrl.rollout.ray_actor.EngineSpec`; :func:`build_engine`
builds the engine a spec names, in this process or inside a Ray engine actor (the actor is
handed this function: the rollout layer below never imports SGLang);
:func:`make_engine` is both, the single-process driver's ``(rollout_cfg, hf_config, seed)``
factory.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..rollout.base import RolloutEngine
from ..rollout.ray_actor import EngineSpec
from ..rollout.reference import ReferenceEngine
from .options import SGLangOptions

__all__ = ["EngineChoice", "build_engine", "engine_spec", "make_engine", "takes_expert_stacks"]


class EngineChoice(Protocol):
    """What the factory reads of the job's rollout options (a
    :class:`~megatron_qrl.config.run.RolloutConfig`; the config layer sits above this one)."""

    engine: str
    """``--qrl-rollout-engine``: ``reference`` or ``sglang``."""
    format: str
    """``--qrl-rollout-format``: the QuantSpec's name."""
    sglang: SGLangOptions
    """``--qrl-rollout-sglang-*``."""


def engine_spec(rollout_cfg: EngineChoice, hf_config: dict, seed: int,
                num_threads: int | None = None, lora: dict | None = None) -> EngineSpec:
    """The engine of ``--qrl-rollout-engine`` (``rollout_cfg``: a
    :class:`~megatron_qrl.config.run.RolloutConfig`). ``num_threads``: torch intra-op threads
    of the reference engine's process (a Ray actor gets the driver's so CPU results match
    single mode bit for bit); an SGLang engine keeps its process's own. ``lora``:
    ``{"lora_rank", "lora_serving"}`` of a LoRA run (SGLang: the adapter-serving engine,
    :class:`~megatron_qrl.rollout_sglang.lora.SGLangLoraEngine`; the reference engine serves
    adapters without it)."""
    if rollout_cfg.engine == "reference":
        return EngineSpec("reference", dict(hf_config), rollout_cfg.format, seed,
                          num_threads=num_threads)
    if rollout_cfg.engine == "sglang":
        return EngineSpec("sglang", dict(hf_config), rollout_cfg.format, seed,
                          sglang=rollout_cfg.sglang, sglang_kwargs=dict(lora or {}))
    raise NotImplementedError(f"--qrl-rollout-engine {rollout_cfg.engine}: no such engine")


def build_engine(spec: EngineSpec) -> RolloutEngine:
    """The engine ``spec`` names: the reference engine (CPU, fp32), an SGLang engine on
    ``spec.sglang_kwargs["model_path"]`` (an HF checkpoint directory), or the job's SGLang
    engine (:func:`~megatron_qrl.rollout_sglang.launch.start_job_engine`: placeholder
    weights until the first sync)."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    if spec.kind == "reference":
        return ReferenceEngine(spec.hf_config, spec.format, device="cpu", dtype=torch.float32,
                               seed=spec.seed)
    from .engine import SGLangEngine
    from .launch import start_job_engine

    kwargs = dict(spec.sglang_kwargs)
    options = spec.sglang if spec.sglang is not None else SGLangOptions()
    if "model_path" in kwargs:
        cls = SGLangEngine
        if "lora_rank" in kwargs:
            from .lora import SGLangLoraEngine as cls
        return cls(kwargs.pop("model_path"), spec.format, options, **kwargs)
    return start_job_engine(options, spec.format, spec.hf_config, spec.seed, **kwargs)


def takes_expert_stacks(spec: EngineSpec) -> bool:
    """Whether the engine ``spec`` names takes expert stacks over its weight stream (an
    SGLang engine whose resolved sync is in place with ``stack_experts``); a Ray driver then
    stacks before it cuts the stream (:class:`~megatron_qrl.rollout.ray_actor.RayEngine`)."""
    if spec.kind != "sglang":
        return False
    options = (spec.sglang if spec.sglang is not None else SGLangOptions()).resolve(spec.format)
    return options.sync == "inplace" and bool(options.stack_experts)


def make_engine(rollout_cfg: EngineChoice, hf_config: dict, seed: int,
                lora: dict | None = None) -> RolloutEngine:
    """The rollout engine named by ``--qrl-rollout-engine``, in this process (``lora``: see
    :func:`engine_spec`)."""
    return build_engine(engine_spec(rollout_cfg, hf_config, seed, lora=lora))
