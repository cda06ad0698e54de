"""The Ray modes with a rollout fleet: ``--qrl-rollout-num-engines N`` engine actors.

A :class:`FleetSession` is a :class:`~megatron_qrl.rl.ray_modes.RaySession` whose placement
group holds one bundle per engine (:func:`~megatron_qrl.rollout.fleet_layout.fleet_layout`:
colocated bundles are fractions / tiles of the trainer's GPUs, disaggregated ones GPUs of
their own, plus the trainer's CPU bundle; an engine of engine TP ``t`` gets a bundle of ``t``
GPUs and its actor starts SGLang with ``tp_size`` / ``ep_size`` / DP attention:
:func:`fleet_engine_spec`), and whose engine factory is an
:class:`~megatron_qrl.rollout.fleet.EngineFleet`: engine ``i`` always starts in bundle ``i``
(a restart too), weights go to all engines over ONE broadcast group
(:class:`~megatron_qrl.rollout.transports.fleet.FleetBroadcast`; the objectstore and ipc transports
send the stream to each engine in turn; ipc, the colocated default, only where every engine
shares the driver's device: a CPU fleet, or one GPU), prompt groups are spread over the engines by the driver.
Colocated: the fleet releases every engine's memory after a rollout and resumes it before the
next sync or rollout, as the single actor does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from megatron_qrl.config.run import RolloutConfig
from megatron_qrl.rl.ray_modes import RaySession, _init_ray, engine_spec
from megatron_qrl.rl.ray_placement import (
    driver_node_selector,
    wait_for_bundle,
    wait_for_placement,
)
from megatron_qrl.rollout.fleet import EngineFleet
from megatron_qrl.rollout.fleet_layout import FleetLayout, engine_parallel, fleet_layout
from megatron_qrl.rollout.ray_actor import EngineActor, EngineSpec, RayEngine, weight_backend
from megatron_qrl.rollout.transports.fleet import FleetBroadcast
from megatron_qrl.rollout_sglang.factory import build_engine, takes_expert_stacks

__all__ = ["FleetSession", "fleet_engine_spec", "session_layout"]


def session_layout(mode: str, rollout_cfg: RolloutConfig, cluster_gpus: int | None = None,
                   gpus_per_node: int | None = None) -> FleetLayout:
    """The fleet layout of ``--qrl-mode`` / the ``--qrl-rollout-*`` fleet flags; colocated
    engines share the trainer's GPUs (this process's CUDA devices, one if it has none)."""
    trainer = (torch.cuda.device_count() or 1) if mode == "colocated" else 0
    return fleet_layout(rollout_cfg.num_engines, rollout_cfg.engine_tp, rollout_cfg.engine_ep,
                        rollout_cfg.engine, mode, cluster_gpus=cluster_gpus,
                        trainer_gpus=trainer, gpus_per_node=gpus_per_node,
                        mem_fraction=rollout_cfg.sglang.mem_fraction)


def fleet_engine_spec(fleet: FleetLayout, rollout_cfg: RolloutConfig, hf_config: dict,
                      seed: int) -> EngineSpec:
    """The engine actors' spec: SGLang engines get the fleet's engine TP / EP (and DP
    attention) as ``sglang.Engine`` arguments, checked against the model
    (:func:`~megatron_qrl.rollout.fleet_layout.engine_parallel`: one clear error)."""
    spec = engine_spec(rollout_cfg, hf_config, seed)
    if spec.kind != "sglang":
        return spec
    par = engine_parallel(hf_config, fleet.engine_tp, fleet.engine_ep,
                          getattr(rollout_cfg, "engine_dp_attention", False))
    if par.tp == 1 and par.ep == 1:
        return spec
    return replace(spec, sglang_kwargs=dict(spec.sglang_kwargs) | par.sglang_args())


def _trainer_ranks() -> bool:
    """Whether this driver is rank 0 of several torchrun trainer ranks."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


class FleetSession(RaySession):
    """Ray + the fleet's placement group (module docstring); a context manager."""

    def __init__(self, mode: str, rollout_cfg: RolloutConfig, **kwargs: Any):
        super().__init__(mode, **kwargs)
        self.rollout_cfg = rollout_cfg
        self.fleet: FleetLayout | None = None

    def __enter__(self) -> FleetSession:
        import ray
        from ray.util.placement_group import placement_group

        self._started = _init_ray()
        need = session_layout(self.mode, self.rollout_cfg)
        self.wait_for_cluster(sum(b.get("GPU", 0.0) for b in need.bundles))
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.num_nodes = len(nodes)
        gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes]
        self.fleet = session_layout(self.mode, self.rollout_cfg, cluster_gpus=sum(gpus),
                                    gpus_per_node=max(gpus, default=0) or None)
        bundles = list(self.fleet.bundles)
        if self.mode == "disaggregated":
            bundles.append({"CPU": 1.0})  # the trainer's share (torchrun owns its GPUs)
        strategy = "SPREAD" if len(nodes) > 1 else "PACK"
        # colocated without torchrun ranks: the engines share this process's device (the
        # ipc transport of `auto`), so every bundle goes to this node
        pinned = self.mode == "colocated" and not _trainer_ranks()
        self.pg = placement_group(bundles, strategy=strategy, bundle_label_selector=(
            driver_node_selector(len(bundles)) if pinned else None))
        wait_for_placement(self, bundles, strategy,
                           f"--qrl-rollout-num-engines {self.fleet.num_engines}",
                           "add GPUs or lower --qrl-rollout-num-engines")
        return self

    def new_engine(self, spec: EngineSpec, index: int) -> RayEngine:
        """A fresh engine actor in bundle ``index`` (engine ``index``'s, restarts included)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.pg is None or self.fleet is None:
            raise RuntimeError("FleetSession.new_engine outside `with FleetSession(...)`")
        wait_for_bundle(self.pg, index, self.pg_timeout_s, f"fleet engine {index}")
        opts = {"num_cpus": 1.0, "num_gpus": self.fleet.gpus_per_engine, "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=index)}
        return RayEngine(ray.remote(EngineActor).options(**opts).remote(spec, build_engine),
                         transport=self.transport(spec), engine_kind=spec.kind,
                         backend=self.backend(spec), timeout_s=self.weight_timeout_s,
                         stack_experts=takes_expert_stacks(spec))

    def shares_device(self) -> bool:
        """Colocated engines sit on every trainer GPU; the driver (rank 0) holds one."""
        return torch.cuda.device_count() <= 1

    def sharded_sync(self) -> bool:
        """Under torchrun the engines' groups take the sharded sync (every EP rank sends its
        own experts, :mod:`megatron_qrl.rl.ep_sync`): ``auto`` is then ``broadcast``."""
        return _trainer_ranks()

    def backend(self, spec: EngineSpec) -> str:
        """NCCL only where every engine has GPUs of its own (never two ranks on one GPU)."""
        shared = self.mode == "colocated" or (self.fleet and self.fleet.engines_per_gpu > 1)
        return weight_backend(spec.kind, colocated=bool(shared))

    def engine_factory(self, rollout_cfg: RolloutConfig, hf_config: dict, seed: int) -> EngineFleet:
        """The driver's engine factory: the fleet of this session."""
        if self.fleet is None:
            raise RuntimeError("FleetSession.engine_factory outside `with FleetSession(...)`")
        spec = fleet_engine_spec(self.fleet, rollout_cfg, hf_config, seed)
        broadcast = None
        if self.announce(spec) == "broadcast":
            broadcast = FleetBroadcast(self.backend(spec), self.weight_timeout_s,
                                       shardable=spec.kind == "reference",
                                       stack_experts=takes_expert_stacks(spec))
        return EngineFleet([lambda i=i: self.new_engine(spec, i)
                            for i in range(self.fleet.num_engines)],
                           group_size=rollout_cfg.n_samples_per_prompt,
                           max_restarts=self.max_restarts, broadcast=broadcast,
                           colocated=self.mode == "colocated")
