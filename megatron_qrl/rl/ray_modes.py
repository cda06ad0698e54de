"""The Ray modes of ``qrl-train``: the rollout engine in a Ray actor, placed by a placement group.

``--qrl-mode disaggregated``: a placement group with one bundle for the engine and one for
the trainer (``STRICT_SPREAD`` over nodes when the cluster has more than one, else ``PACK``);
the engine actor runs in bundle 0, the trainer stays in the driver process (bundle 1 reserves
its share). ``--qrl-mode colocated``: one bundle shared by the engine actor and the trainer;
the engine's memory is released after each rollout (before recompute + training) and
resumed before the next weight sync::

    sync(v) -> generate -> release_memory -> recompute, train -> resume_memory -> sync(v+1)

Weight sync, verification and seeding are the single-process ones (:mod:`megatron_qrl.rl.sync`),
so with the same seed a Ray mode produces the same metrics as ``--qrl-mode single``; the
packed stream reaches the actor as handles to buckets in shared GPU / CPU memory
(``--qrl-ray-weight-transport ipc``, the default of ``colocated``), over a driver <-> actor
process group (``broadcast``, the default of ``disaggregated``) or through the object store
(``objectstore``), see :mod:`megatron_qrl.rollout.ray_actor`. The
actor is supervised: if it dies — in a rollout, or during a weight sync (the update, the
verification read-back) — :class:`EngineSupervisor` starts a new actor in the same bundle and
re-runs the driver's sync of the current version on it (the driver binds its ``sync``, which
re-packs the trainer's current weights, through :meth:`RayRolloutEngine.bind_resync`); a
rollout is then retried, an interrupted sync is complete (its one-shot stream is not re-sent);
``--qrl-engine-max-restarts`` bounds the restarts within one call.

Under ``torchrun`` (a multi-rank TP / EP trainer) rank 0 alone joins Ray, holds the
:class:`RaySession` and the engine actor; the other ranks never touch Ray (rollouts are
broadcast from rank 0, a sync gathers the weights to rank 0, as in ``--qrl-mode single``).
The trainer ranks are torchrun's, not Ray's: the trainer bundle reserves a CPU only, so on
GPUs give the Ray cluster the engine's GPUs only (``CUDA_VISIBLE_DEVICES=<engine GPUs> ray
start --num-gpus N``) in disaggregated mode, or run colocated, where the engine's bundle is
the GPU of the trainer's rank 0 (a one-GPU Ray instance on that GPU).

Ray: ``ray.init()`` joins the running cluster (``RAY_ADDRESS``, or the one ``ray start`` left
in ``/tmp/ray``) or else starts a local instance. ``--qrl-rollout-engine sglang``: the actor
asks for 1 GPU (one SGLang engine, TP 1) and starts it as ``make_engine`` does in single
mode (config-only directory, ``load_format="dummy"``, filled by the first sync).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_qrl.config.run import RolloutConfig
from megatron_qrl.rl.ray_placement import (
    driver_node_selector,
    wait_for_bundle,
    wait_for_cluster,
    wait_for_placement,
)
from megatron_qrl.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from megatron_qrl.rollout.capacity import EngineCapacity
from megatron_qrl.rollout.ray_actor import (
    WEIGHT_TRANSPORTS,
    EngineActor,
    EngineSpec,
    RayEngine,
    pick_transport,
    weight_backend,
)
from megatron_qrl.rollout.supervisor import EngineSupervisor
from megatron_qrl.rollout_sglang.factory import build_engine, takes_expert_stacks
from megatron_qrl.rollout_sglang.factory import engine_spec as _engine_spec

__all__ = ["RAY_MODES", "RayRolloutEngine", "RaySession", "actor_options", "engine_gpus",
           "engine_spec", "placement_layout", "wait_for_placement"]

RAY_MODES = ("colocated", "disaggregated")
_REPO_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class PlacementLayout:
    """Bundles of the job's placement group and which one the engine actor uses."""

    bundles: list[dict[str, float]]
    strategy: str
    engine_bundle: int
    engine_resources: dict[str, float]


def placement_layout(mode: str, num_nodes: int, engine_gpus: float = 0.0,
                     trainer_gpus: float = 0.0) -> PlacementLayout:
    """The placement group of ``mode`` on a cluster of ``num_nodes`` alive nodes."""
    if mode not in RAY_MODES:
        raise ValueError(f"--qrl-mode {mode!r}: the Ray modes are {RAY_MODES}")
    if num_nodes < 1:
        raise ValueError(f"the Ray cluster has no alive node (num_nodes={num_nodes})")

    def res(gpus: float) -> dict[str, float]:
        return {"CPU": 1.0, **({"GPU": gpus} if gpus else {})}

    if mode == "colocated":
        shared = res(max(engine_gpus, trainer_gpus))
        return PlacementLayout([shared], "PACK", 0, dict(shared))
    strategy = "STRICT_SPREAD" if num_nodes > 1 else "PACK"
    return PlacementLayout([res(engine_gpus), res(trainer_gpus)], strategy, 0, res(engine_gpus))


def _init_ray() -> bool:
    """Connect to ``RAY_ADDRESS`` (or start a local cluster); True if this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    path = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    return True


def engine_spec(rollout_cfg: RolloutConfig, hf_config: dict, seed: int) -> EngineSpec:
    """The actor's :class:`EngineSpec` for ``--qrl-rollout-engine`` (``rollout_cfg``); a
    reference engine runs with this process's torch threads (CPU results as in single mode)."""
    return _engine_spec(rollout_cfg, hf_config, seed, num_threads=torch.get_num_threads())


def actor_options(layout: PlacementLayout, spec: EngineSpec, pg: Any = None) -> dict[str, Any]:
    """``ray.remote(EngineActor).options(...)`` of ``spec``'s actor in ``layout``'s engine
    bundle (``pg``: the placement group; None leaves the scheduling strategy out)."""
    res = layout.engine_resources
    if spec.num_gpus > res.get("GPU", 0):
        raise RuntimeError(
            f"the {spec.kind} engine actor needs {spec.num_gpus} GPU(s) but the Ray session's "
            f"engine bundle {res} has {res.get('GPU', 0)}; open RaySession(..., "
            f"engine_gpus={spec.num_gpus})")
    opts: dict[str, Any] = {"num_cpus": res["CPU"], "num_gpus": spec.num_gpus,
                            "max_restarts": 0}
    if pg is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=layout.engine_bundle)
    return opts


def engine_gpus(rollout_cfg: RolloutConfig) -> int:
    """GPUs of the engine bundle for ``--qrl-rollout-engine`` (1: SGLang, 0: reference)."""
    return _engine_spec(rollout_cfg, {}, 0).num_gpus


class RaySession:
    """Ray + the placement group of one ``qrl-train`` invocation (a context manager).

    ``session.engine_factory`` has the driver's ``(rollout_cfg, hf_config, seed) -> engine``
    signature and builds a supervised :class:`RayRolloutEngine`.
    """

    def __init__(self, mode: str, pg_timeout_s: float = 120.0, max_restarts: int = 2,
                 engine_gpus: int = 0, weight_transport: str = "auto",
                 weight_timeout_s: float = 300.0, ray_nodes: int = 0):
        if mode not in RAY_MODES:
            raise ValueError(f"--qrl-mode {mode!r}: the Ray modes are {RAY_MODES}")
        if weight_transport not in ("auto", *WEIGHT_TRANSPORTS):
            raise ValueError(f"--qrl-ray-weight-transport {weight_transport!r}: choose auto or "
                             f"one of {WEIGHT_TRANSPORTS}")
        self.mode, self.pg_timeout_s, self.max_restarts = mode, pg_timeout_s, max_restarts
        self.weight_transport, self.weight_timeout_s = weight_transport, weight_timeout_s
        self.engine_gpus, self.ray_nodes = engine_gpus, ray_nodes
        self.pg: Any = None
        self.layout: PlacementLayout | None = None
        self.num_nodes = 1
        self._started = False

    def __enter__(self) -> RaySession:
        import ray
        from ray.util.placement_group import placement_group

        self._started = _init_ray()
        self.wait_for_cluster(self.engine_gpus)
        nodes = self.num_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        self.layout = placement_layout(self.mode, nodes, engine_gpus=self.engine_gpus)
        # colocated: the engine shares rank 0's device, so its bundle is on rank 0's node
        pinned = driver_node_selector(1) if self.mode == "colocated" else None
        self.pg = placement_group(self.layout.bundles, strategy=self.layout.strategy,
                                  bundle_label_selector=pinned)
        wait_for_placement(self, self.layout.bundles, self.layout.strategy,
                           f"--qrl-mode {self.mode}", "add nodes/CPUs/GPUs")
        return self

    def wait_for_cluster(self, gpus: float) -> None:
        """Wait for ``--qrl-launch-ray-nodes`` nodes and ``gpus`` GPUs (the start-up
        timeout; closes the session and raises one line after it)."""
        try:
            wait_for_cluster(self.ray_nodes, gpus, self.pg_timeout_s)
        except Exception:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self._started:
            ray.shutdown()
            self._started = False

    def new_actor(self, spec: EngineSpec) -> RayEngine:
        """A fresh engine actor in the engine's bundle."""
        import ray

        if self.pg is None or self.layout is None:
            raise RuntimeError("RaySession.new_actor outside `with RaySession(...)`")
        wait_for_bundle(self.pg, self.layout.engine_bundle, self.pg_timeout_s,
                        "the rollout engine actor")
        opts = actor_options(self.layout, spec, self.pg)
        return RayEngine(ray.remote(EngineActor).options(**opts).remote(spec, build_engine),
                         transport=self.transport(spec), engine_kind=spec.kind,
                         backend=weight_backend(spec.kind, colocated=self.mode == "colocated"),
                         timeout_s=self.weight_timeout_s,
                         stack_experts=takes_expert_stacks(spec))

    def shares_device(self) -> bool:
        """Whether a colocated engine runs on the driver's device (the one engine bundle is
        the GPU of the trainer's rank 0)."""
        return True

    def sharded_sync(self) -> bool:
        """Whether every rank sends its own part of the weights (no: one driver sends all)."""
        return False

    def transport(self, spec: EngineSpec) -> str:
        """The weight transport of ``spec``'s actors (``auto`` resolved, ``ipc`` checked:
        :func:`~megatron_qrl.rollout.ray_actor.pick_transport`)."""
        return pick_transport(self.weight_transport, self.mode == "colocated",
                              self.shares_device(), spec.kind, self.num_nodes,
                              sharded=self.sharded_sync())

    def announce(self, spec: EngineSpec) -> str:
        """Resolve and print the weight transport of ``spec``'s actors (one line)."""
        chosen = self.transport(spec)
        how = f" (--qrl-ray-weight-transport {self.weight_transport})" \
            if self.weight_transport == "auto" else ""
        print(f"[qrl-train] weight transport: {chosen}{how}, --qrl-mode {self.mode}",
              flush=True)
        return chosen

    def engine_factory(self, rollout_cfg: RolloutConfig, hf_config: dict, seed: int) -> RayRolloutEngine:
        """The driver's engine factory for this session's mode."""
        spec = engine_spec(rollout_cfg, hf_config, seed)
        self.announce(spec)  # an ipc engine that cannot open the trainer's memory: say so now
        if self.layout is not None:
            actor_options(self.layout, spec)  # a GPU engine in a CPU bundle: say so now
        return RayRolloutEngine(lambda: self.new_actor(spec), colocated=self.mode == "colocated",
                                max_restarts=self.max_restarts)


class RayRolloutEngine(RolloutEngine):
    """A supervised actor engine; in colocated mode it also releases / resumes memory."""

    def __init__(self, new_actor: Callable[[], RayEngine], colocated: bool,
                 max_restarts: int = 2):
        self._resync: Callable[[int], Any] | None = None
        self.supervisor = EngineSupervisor(new_actor, self._do_resync, max_restarts)
        self.colocated = colocated
        self.released = False

    def bind_resync(self, sync: Callable[[int], Any]) -> None:
        """``sync(version)``: the driver's re-pack + send of the trainer's current weights."""
        self._resync = sync

    def _do_resync(self, engine: RolloutEngine, version: int) -> None:
        if self._resync is None:
            raise RuntimeError("the rollout engine actor died and no re-sync is bound (the "
                               "driver calls RayRolloutEngine.bind_resync(sync))")
        self.released = False  # the new actor starts with its memory resumed
        # goes through self -> supervisor (unsupervised while it re-syncs) -> the new actor
        self._resync(version)

    @property
    def actor(self) -> RayEngine:
        """The current actor proxy (changes after a restart)."""
        return self.supervisor.engine

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self.released:
            self.resume_memory()
        self.supervisor.update_weights(named_tensors, version)

    def held_checksums(self) -> dict[str, str]:
        return self.supervisor.held_checksums()

    def weight_version(self) -> int:
        return self.supervisor.weight_version()

    def capacity(self) -> EngineCapacity | None:
        return self.supervisor.capacity()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        if self.released:
            self.resume_memory()
        out = self.supervisor.generate(prompts, sampling)
        if self.colocated:
            self.release_memory()  # the trainer's recompute + update run next
        return out

    def release_memory(self) -> None:
        self.supervisor.release_memory()
        self.released = True

    def resume_memory(self) -> None:
        self.supervisor.resume_memory()
        self.released = False

    def shutdown(self) -> None:
        self.supervisor.shutdown()
