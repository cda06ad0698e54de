"""Where a rollout fleet's engines run: N engines of engine-TP GPUs each, checked up front.

Pure functions: :func:`fleet_layout` turns the fleet flags (``--qrl-rollout-num-engines``,
``--qrl-rollout-engine-tp``, ``--qrl-rollout-engine-ep``) and what the cluster offers into the
placement-group bundles of the engines (one bundle per engine, so a restarted engine comes
back on the same GPUs), or raises ONE error naming the flag and the fix.

Rules (SGLang 0.5: an engine's expert-parallel group is made of its own TP ranks, so
``ep_size`` divides ``tp_size`` and EP adds no GPUs; an engine's TP ranks live on one node):

* the reference engine is one process: engine TP = EP = 1;
* engine TP > 1 needs a bundle of ``tp`` GPUs on one node (``tp <= gpus_per_node``);
* disaggregated: ``num_engines * tp`` GPUs of their own, next to the trainer's;
* colocated: the engines share the trainer's GPUs; ``num_engines * tp`` must fill them
  (a multiple of them when TP = 1: several engines per GPU, each a fraction of it, whose
  ``mem_fraction_static`` together must stay below 1).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FleetLayout", "fleet_layout"]


@dataclass(frozen=True)
class FleetLayout:
    """The engines' bundles: ``bundles[i]`` is engine ``i``'s (``{"CPU": 1, "GPU": g}``)."""

    num_engines: int
    engine_tp: int
    engine_ep: int
    gpus_per_engine: float
    """GPUs (or a fraction of one) each engine's actor asks Ray for; 0 for the reference."""
    engines_per_gpu: int
    bundles: tuple[dict[str, float], ...]

    @property
    def total_gpus(self) -> float:
        return self.num_engines * self.gpus_per_engine


def _positive(flag: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")
    return value


def fleet_layout(num_engines: int, engine_tp: int = 1, engine_ep: int = 1,
                 engine_kind: str = "reference", mode: str = "disaggregated",
                 cluster_gpus: int | None = None, trainer_gpus: int = 0,
                 gpus_per_node: int | None = None, mem_fraction: float = 0.5) -> FleetLayout:
    """The bundles of ``num_engines`` engines (module docstring), or one clear error.

    ``cluster_gpus``: GPUs of the Ray cluster (None: not checked); ``trainer_gpus``: the
    trainer's (colocated: the GPUs the engines share); ``gpus_per_node``: the largest node's.
    """
    n = _positive("--qrl-rollout-num-engines", num_engines)
    tp = _positive("--qrl-rollout-engine-tp", engine_tp)
    ep = _positive("--qrl-rollout-engine-ep", engine_ep)
    if engine_kind == "reference":
        if tp > 1 or ep > 1:
            raise ValueError(f"--qrl-rollout-engine-tp {tp} / --qrl-rollout-engine-ep {ep}: the "
                             "reference engine is one process (TP = EP = 1); use "
                             "--qrl-rollout-engine sglang for engine TP / EP")
        return FleetLayout(n, 1, 1, 0.0, 1, tuple({"CPU": 1.0} for _ in range(n)))
    if tp % ep:
        raise ValueError(f"--qrl-rollout-engine-ep {ep} must divide --qrl-rollout-engine-tp "
                         f"{tp}: SGLang's expert-parallel group is made of the engine's TP ranks "
                         "(EP adds no GPUs); e.g. --qrl-rollout-engine-ep "
                         f"{tp if tp > 1 else 1}")
    if gpus_per_node is not None and tp > gpus_per_node:
        raise ValueError(f"--qrl-rollout-engine-tp {tp}: an engine's TP ranks share one node "
                         f"(one placement-group bundle of {tp} GPUs), and the largest node has "
                         f"{gpus_per_node}; lower --qrl-rollout-engine-tp to <= {gpus_per_node} "
                         "and raise --qrl-rollout-num-engines instead")
    if mode == "colocated":
        return _colocated(n, tp, ep, trainer_gpus, mem_fraction)
    if mode != "disaggregated":
        raise ValueError(f"fleet_layout: mode {mode!r} is not a Ray mode "
                         "(colocated / disaggregated)")
    need = n * tp
    if cluster_gpus is not None and need + trainer_gpus > cluster_gpus:
        raise ValueError(
            f"--qrl-rollout-num-engines {n} x --qrl-rollout-engine-tp {tp} = {need} engine GPUs "
            f"+ {trainer_gpus} trainer GPUs > the cluster's {cluster_gpus}; lower "
            f"--qrl-rollout-num-engines to <= {max(0, cluster_gpus - trainer_gpus) // tp}, or "
            "run --qrl-mode colocated (engines on the trainer's GPUs)")
    return FleetLayout(n, tp, ep, float(tp), 1,
                       tuple({"CPU": 1.0, "GPU": float(tp)} for _ in range(n)))


def _colocated(n: int, tp: int, ep: int, trainer_gpus: int, mem_fraction: float) -> FleetLayout:
    if trainer_gpus < 1:
        raise ValueError("--qrl-mode colocated with SGLang engines: the trainer has no GPU "
                         "to share (run on a GPU machine, or --qrl-mode disaggregated)")
    need = n * tp
    if tp > 1 and need != trainer_gpus:
        raise ValueError(
            f"--qrl-mode colocated: {n} engines x --qrl-rollout-engine-tp {tp} = {need} GPUs, "
            f"but the trainer has {trainer_gpus}; colocated engines with TP > 1 tile the "
            f"trainer's GPUs exactly (--qrl-rollout-num-engines {max(1, trainer_gpus // tp)})")
    if tp == 1 and need % trainer_gpus:
        raise ValueError(
            f"--qrl-mode colocated: --qrl-rollout-num-engines {n} must be a multiple of the "
            f"trainer's {trainer_gpus} GPUs (every GPU holds the same number of engines)")
    per_gpu = max(1, need // trainer_gpus)
    if per_gpu * mem_fraction >= 1.0:
        raise ValueError(
            f"--qrl-mode colocated: {per_gpu} engines share each GPU, each with "
            f"--qrl-rollout-sglang-mem-fraction {mem_fraction}: together >= 1 of the GPU; "
            f"lower it below {1.0 / per_gpu:.3f} (the trainer needs its share too)")
    gpus = float(tp) if tp > 1 else 1.0 / per_gpu
    return FleetLayout(n, tp, ep, gpus, per_gpu,
                       tuple({"CPU": 1.0, "GPU": gpus} for _ in range(n)))
