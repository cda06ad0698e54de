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

__all__ = ["EngineParallel", "FleetLayout", "engine_parallel", "fleet_layout"]


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
        one = (" (a one-GPU machine runs engine TP 1: several engines share the GPU, each "
               "with a fraction of --qrl-rollout-sglang-mem-fraction; engine TP > 1 needs a "
               "multi-GPU node)" if gpus_per_node == 1 else "")
        raise ValueError(f"--qrl-rollout-engine-tp {tp}: an engine's TP ranks share one node "
                         f"(one placement-group bundle of {tp} GPUs), and the largest node has "
                         f"{gpus_per_node}; lower --qrl-rollout-engine-tp to <= {gpus_per_node} "
                         f"and raise --qrl-rollout-num-engines instead{one}")
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


@dataclass(frozen=True)
class EngineParallel:
    """How one SGLang engine of the fleet splits the model over its ``tp`` GPUs."""

    tp: int
    ep: int = 1
    dp_attention: bool = False
    """SGLang DP attention: attention data-parallel over the engine's ranks (``dp_size`` =
    ``tp``, attention TP 1), experts and dense MLPs still TP / EP over them."""

    @property
    def attn_tp(self) -> int:
        """Ranks one attention layer is split over (SGLang ``tp_size // dp_size``)."""
        return 1 if self.dp_attention else self.tp

    @property
    def moe_tp(self) -> int:
        """Ranks one expert is split over (SGLang ``moe_tp_size = tp_size // ep_size``)."""
        return self.tp // self.ep

    def sglang_args(self) -> dict:
        """The ``sglang.Engine`` (ServerArgs, SGLang 0.5.17) arguments of this split."""
        args: dict = {"tp_size": self.tp, "ep_size": self.ep}
        if self.dp_attention:
            args |= {"enable_dp_attention": True, "dp_size": self.tp}
        return args


def _cfg_int(hf_config: dict, *keys: str) -> int | None:
    for k in keys:
        if hf_config.get(k) is not None:
            return int(hf_config[k])
    return None


def engine_parallel(hf_config: dict, tp: int = 1, ep: int = 1,
                    dp_attention: bool = False) -> EngineParallel:
    """Check that an SGLang 0.5.17 engine of engine TP ``tp`` / EP ``ep`` can hold the model
    of ``hf_config`` (the rules SGLang asserts at start-up, raised here up front as ONE error
    naming the flag): attention heads divisible by the attention TP (``tp``, or 1 with DP
    attention), KV heads divisible by it or dividing it (SGLang replicates KV heads when the
    TP is larger), routed experts divisible by EP, the expert FFN width by ``tp / ep`` and
    the dense FFN width by ``tp``; DP attention only on a MoE model (SGLang: Qwen2/3-MoE and
    DeepSeek) with engine TP > 1."""
    par = EngineParallel(_positive("--qrl-rollout-engine-tp", tp),
                         _positive("--qrl-rollout-engine-ep", ep), bool(dp_attention))
    if tp % ep:
        raise ValueError(f"--qrl-rollout-engine-ep {ep} must divide --qrl-rollout-engine-tp {tp}")
    experts = _cfg_int(hf_config, "num_experts", "num_local_experts")
    where = f"--qrl-rollout-engine-tp {tp}" + (" with --qrl-rollout-engine-dp-attention"
                                                if dp_attention else "")
    if dp_attention and (not experts or tp == 1):
        raise ValueError("--qrl-rollout-engine-dp-attention: SGLang's DP attention is for MoE "
                         "models (Qwen2/3-MoE, DeepSeek) with --qrl-rollout-engine-tp > 1; "
                         f"this model has {experts or 'no'} experts and engine TP {tp}")
    heads = _cfg_int(hf_config, "num_attention_heads")
    kv = _cfg_int(hf_config, "num_key_value_heads") or heads
    a = par.attn_tp
    if heads is not None and heads % a:
        raise ValueError(f"{where}: the model's {heads} attention heads do not split over "
                         f"{a} ranks; use an engine TP dividing {heads}"
                         + ("" if dp_attention or not experts else
                            " (or --qrl-rollout-engine-dp-attention)"))
    if kv is not None and (kv % a if a <= kv else a % kv):
        raise ValueError(f"{where}: the model's {kv} KV heads neither split over nor replicate "
                         f"evenly on {a} ranks (SGLang needs {kv} % TP == 0 or TP % {kv} == 0)")
    if ep > 1 and not experts:
        raise ValueError(f"--qrl-rollout-engine-ep {ep}: the model has no experts; use 1")
    if experts and experts % ep:
        raise ValueError(f"--qrl-rollout-engine-ep {ep}: the model's {experts} experts do not "
                         f"split evenly over {ep} expert-parallel ranks; use a divisor of "
                         f"{experts}")
    width = _cfg_int(hf_config, "moe_intermediate_size")
    if experts and width is not None and width % par.moe_tp:
        raise ValueError(f"--qrl-rollout-engine-tp {tp} / --qrl-rollout-engine-ep {ep}: each "
                         f"expert's FFN width {width} does not split over tp/ep = {par.moe_tp} "
                         "ranks; raise --qrl-rollout-engine-ep")
    dense = _cfg_int(hf_config, "intermediate_size")
    if not experts and dense is not None and dense % tp:
        raise ValueError(f"--qrl-rollout-engine-tp {tp}: the FFN width {dense} does not split "
                         f"over {tp} ranks")
    return par
