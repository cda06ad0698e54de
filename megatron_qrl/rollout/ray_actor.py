"""A rollout engine in a Ray actor, behind the same :class:`RolloutEngine` interface.

:class:`EngineActor` (run as ``ray.remote``) builds the engine an :class:`EngineSpec` names
inside the actor process, with the engine factory it is handed
(:func:`megatron_qrl.rollout_sglang.factory.build_engine`: the reference engine, or SGLang's
with its engine TP's GPUs per actor; this layer never imports SGLang), and :class:`RayEngine` is the
driver-side proxy whose methods call the actor. ``verify`` compares the actor's
``held_checksums`` with the sender's :class:`WeightManifest` exactly as in single mode. The
packed ``(hf_name, tensor)`` stream reaches the actor by one of the side-``ray`` transports
of :mod:`megatron_qrl.rollout.transports` (:func:`pick_transport` chooses one where
``--qrl-ray-weight-transport`` is ``auto``): ``broadcast`` (the default, a 2-rank process
group with the actor), ``ipc`` (the default of ``--qrl-mode colocated``: handles to buckets
in shared GPU / CPU memory) or ``objectstore`` (``ray.put`` per bucket). The actor's
receiving calls are here (``update_weights_broadcast`` / ``_ipc`` / ``_sharded`` /
``update_weights``); what a transport needs of the actor is its
:class:`~megatron_qrl.rollout.transports.link.ActorLink`.

A dead actor (``RayActorError`` / ``ActorDiedError``) surfaces as :class:`EngineDiedError`,
which :class:`EngineSupervisor` restarts; so does a broadcast (or ipc handle) that fails (gloo measured with
torch 2.13: a send to a dead peer fails at once with "Connection closed by peer"; to a live
peer that does not receive it times out after the group's ``timeout_s``). After a failed
broadcast the driver drains the rest of the stream (under torchrun it is a gather of every
trainer rank, which must complete on all of them) and kills the actor; the restarted actor
gets a new group, and the old one is destroyed on the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..quant.expert_stacks import stack_experts
from ..sync.protocol.wire import CutStream
from ..sync.transport import WeightTransport, transport_class, transport_names
from .base import GenerationOutput, RolloutEngine, SamplingParams
from .broadcast import init_group, receive_stream
from .capacity import EngineCapacity
from .ipc import misplaced, receive_ipc_stream, visible_devices
from .supervisor import EngineDiedError
from .transports import ActorLink
from .transports.objectstore import from_wire
from .weight_groups import receive_sharded

__all__ = ["WEIGHT_TRANSPORTS", "EngineActor", "EngineBuilder", "EngineSpec", "RayEngine",
           "pick_transport", "weight_backend"]

WEIGHT_TRANSPORTS = transport_names("ray")
"""How :class:`RayEngine` sends weights to its actor (the side-``ray`` transports of
:mod:`megatron_qrl.rollout.transports`), the choices of ``--qrl-ray-weight-transport``
besides ``auto``."""


@dataclass(frozen=True)
class EngineSpec:
    """What the actor builds (picklable): ``kind`` ``reference`` (transformers, CPU) or
    ``sglang``, made by :func:`megatron_qrl.rollout_sglang.factory.engine_spec`.

    ``sglang`` without ``sglang_kwargs["model_path"]`` is the job engine of
    ``--qrl-rollout-engine sglang``: :func:`megatron_qrl.rollout_sglang.launch.start_job_engine`
    runs INSIDE the actor (its config-only directory is written on the actor's node) with
    ``load_format="dummy"``; the driver's first weight sync fills every weight.
    """

    kind: str
    hf_config: dict
    format: str
    seed: int = 0
    num_threads: int | None = None
    """torch intra-op threads in the actor (None: Ray's default); the driver passes its own
    so CPU results match single mode bit for bit."""
    sglang: Any = None
    """Kind ``sglang``: the job's :class:`~megatron_qrl.rollout_sglang.options.SGLangOptions`
    (None: their defaults)."""
    sglang_kwargs: dict = field(default_factory=dict)
    """Extra ``SGLangEngine`` keyword arguments for kind ``sglang``; with ``model_path`` the
    engine starts from that HF checkpoint directory instead of the job's config-only one."""

    def __post_init__(self) -> None:
        if self.kind not in ("reference", "sglang"):
            raise ValueError(f"EngineSpec.kind must be 'reference' or 'sglang', got {self.kind!r}")
        tp = self.sglang_kwargs.get("tp_size", 1)
        if not isinstance(tp, int) or tp < 1 or (self.kind == "reference" and tp != 1):
            raise ValueError(f"EngineSpec(kind={self.kind!r}, tp_size={tp!r}): an integer >= 1, "
                             "and 1 for the reference engine (one process)")

    @property
    def num_gpus(self) -> int:
        """GPUs the actor asks Ray for: the SGLang engine's TP size, 0 for the reference."""
        return int(self.sglang_kwargs.get("tp_size", 1)) if self.kind == "sglang" else 0


EngineBuilder = Callable[[EngineSpec], RolloutEngine]
"""Builds the engine a spec names (``megatron_qrl.rollout_sglang.factory.build_engine``)."""


class EngineActor:
    """The actor body: owns one engine, built at construction inside the actor process by
    ``build`` (a module-level function: Ray pickles it by reference)."""

    def __init__(self, spec: EngineSpec, build: EngineBuilder):
        self.engine = build(spec)
        self.calls: list[str] = []
        self.weight_group: Any = None
        self.weight_groups: list[Any] = []
        self.weight_device = "cpu"

    def join_weight_group(self, host: str, port: int, world_size: int, rank: int,
                          group_name: str, backend: str, timeout_s: float = 600.0,
                          more: Sequence[tuple[str, int, str]] = ()) -> None:
        """Join the driver's weight group (:func:`~megatron_qrl.rollout.broadcast.init_group`;
        the driver is rank 0 and hosts the rendezvous at ``host:port``); ``more``: the other
        senders' groups ``(host, port, name)`` of a sharded sync (trainer EP > 1,
        :mod:`~megatron_qrl.rollout.weight_groups`), joined in order at the same rank."""
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError(f"join_weight_group({group_name!r}): backend nccl but this actor "
                               "sees no CUDA device; use backend gloo")
        self.weight_device = "cuda" if backend == "nccl" else "cpu"
        self.weight_groups = [init_group(h, p, world_size, rank, n, backend, timeout_s)
                              for h, p, n in [(host, port, group_name), *more]]
        self.weight_group = self.weight_groups[0]

    def update_weights_broadcast(self, version: int) -> None:
        """Load the stream the driver broadcasts on the weight group as ``version``."""
        if self.weight_group is None:
            raise RuntimeError("update_weights_broadcast before join_weight_group")
        self._load_from_group(receive_stream(self.weight_group, self.weight_device), version)

    def update_weights_ipc(self, version: int) -> None:
        """Load the buckets whose handles the driver sends on the weight group
        (:func:`~megatron_qrl.rollout.ipc.receive_ipc_stream`) as ``version``."""
        if self.weight_group is None:
            raise RuntimeError("update_weights_ipc before join_weight_group")
        self._load_from_group(receive_ipc_stream(self.weight_group), version,
                              own=getattr(self.engine, "reshares_stream", False))

    def ipc_peer(self) -> tuple[str, list[str]]:
        """``(Ray node id, UUIDs of the CUDA devices this actor sees)``: where the ipc
        transport's shared buckets must be."""
        import ray

        return ray.get_runtime_context().get_node_id(), visible_devices()

    def _load_from_group(self, stream: Iterator[tuple[str, torch.Tensor]], version: int,
                         own: bool = False) -> None:
        """``own``: the engine gets copies this process owns (an engine that shares the
        stream's tensors on by CUDA IPC cannot share tensors this process received by CUDA
        IPC: :attr:`~.base.RolloutEngine.reshares_stream`)."""
        self.calls.append("update_weights")
        feed = ((name, t.clone()) for name, t in stream) if own else stream
        try:
            self.engine.update_weights(feed, version)
        except Exception:
            _drain(stream)  # the driver's sends complete; the engine's error reaches it
            raise
        _drain(stream)  # an engine that stopped before the end-of-stream header

    def update_weights_sharded(self, version: int) -> None:
        """Load a sharded sync (every sender's segments, ``receive_sharded``) as ``version``;
        on an error the groups are destroyed (the senders' pending broadcasts fail now)."""
        if self.weight_group is None:
            raise RuntimeError("update_weights_sharded before join_weight_group")
        self.calls.append("update_weights")
        stream = receive_sharded(self.weight_groups, self.weight_device)
        try:
            self.engine.update_weights(stream, version)
            _drain(stream)
        except Exception:
            for group in self.weight_groups:
                try:
                    torch.distributed.destroy_process_group(group)
                except Exception:  # noqa: BLE001 - best effort: the sync failed anyway
                    pass
            self.weight_group, self.weight_groups = None, []
            raise

    def update_weights(self, bucket_refs: list[Any], version: int) -> None:
        import ray

        self.calls.append("update_weights")

        def received() -> Iterator[list[tuple[str, torch.Tensor]]]:
            for ref in bucket_refs:  # the driver's buckets, kept (CutStream)
                yield [(name, from_wire(t)) for name, t in ray.get(ref)]

        self.engine.update_weights(CutStream(received()), version)

    def held_checksums(self) -> dict[str, str]:
        return self.engine.held_checksums()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        self.calls.append("generate")
        return self.engine.generate(prompts, sampling)

    def weight_version(self) -> int:
        return self.engine.weight_version()

    def capacity(self) -> EngineCapacity | None:
        return self.engine.capacity()

    def release_memory(self) -> None:
        self.calls.append("release_memory")
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.calls.append("resume_memory")
        self.engine.resume_memory()

    def call_log(self) -> list[str]:
        """The update / generate / release / resume calls this actor served, in order."""
        return list(self.calls)

    def placement_group_id(self) -> str | None:
        """Hex id of the placement group this actor runs in (None outside one)."""
        import ray

        return ray.get_runtime_context().get_placement_group_id()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _drain(stream: Iterator[Any]) -> None:
    """Read ``stream`` to its end (a receive error there is the driver's to report)."""
    try:
        for _ in stream:
            pass
    except Exception:  # noqa: BLE001 - the group is broken: the driver sees its own error
        pass


def weight_backend(engine_kind: str, colocated: bool = False) -> str:
    """The weight group's backend: ``nccl`` when this (driver) process has CUDA and the
    engine is SGLang on another GPU (GPU tensors on both sides), else ``gloo``. Colocated
    engines share the driver's GPU, where NCCL cannot hold both ranks ("Duplicate GPU")."""
    if engine_kind == "sglang" and torch.cuda.is_available() and not colocated:
        return "nccl"
    return "gloo"


def pick_transport(requested: str, colocated: bool, shares_device: bool, engine_kind: str,
                   num_nodes: int = 1, sharded: bool = False) -> str:
    """The weight transport for ``--qrl-ray-weight-transport requested`` (``auto`` or one of
    :data:`WEIGHT_TRANSPORTS`), the one place ``auto`` is resolved: ``broadcast`` where the
    sync is ``sharded`` (under torchrun every EP rank sends its own experts,
    :mod:`megatron_qrl.rl.ep_sync`), else ``ipc`` for a colocated engine that shares the
    driver's device (``shares_device``; a CPU engine always does) and ``broadcast``
    otherwise. An explicit ``ipc`` for an engine that cannot open the driver's memory (a
    disaggregated SGLang engine has a GPU of its own; on a cluster of more than one node a
    disaggregated engine may be on another node; a colocated engine on another GPU) is one
    error naming the flag and the fix."""
    if requested not in ("auto", *WEIGHT_TRANSPORTS):
        raise ValueError(f"--qrl-ray-weight-transport {requested!r}: choose auto or one of "
                         f"{WEIGHT_TRANSPORTS}")
    if requested == "auto" and sharded:
        return "broadcast"
    shares = (colocated and (shares_device or engine_kind != "sglang")) or (
        not colocated and engine_kind != "sglang" and num_nodes == 1)
    if requested == "auto":
        return "ipc" if colocated and shares else "broadcast"
    if requested == "ipc" and not shares:
        raise ValueError(misplaced(
            "a colocated SGLang engine on another GPU than the trainer's rank 0" if colocated
            else f"a disaggregated {engine_kind} engine (its own GPU, or another node of the "
            f"{num_nodes}-node cluster)"))
    return requested


class RayEngine(RolloutEngine):
    """Driver-side proxy of an :class:`EngineActor` handle (``actor``).

    ``transport``: one of :data:`WEIGHT_TRANSPORTS` (module docstring). ``backend``: the
    broadcast group's (``gloo`` / ``nccl``; None: :func:`weight_backend` of ``engine_kind``;
    always ``gloo`` for ``ipc``, whose group carries handles only). ``timeout_s``: the
    group's rendezvous and per-broadcast timeout. ``stack_experts``: the actor's engine
    takes expert stacks (an in-place SGLang sync,
    :func:`~megatron_qrl.rollout_sglang.factory.takes_expert_stacks`): the driver stacks each
    layer's experts before it cuts the stream, since the engine keeps the driver's buckets
    (:class:`~megatron_qrl.sync.protocol.wire.CutStream`) and cannot stack across them.
    """

    def __init__(self, actor: Any, bucket_bytes: int = 256 * 2**20,
                 transport: str = "objectstore", backend: str | None = None,
                 engine_kind: str = "reference", timeout_s: float = 300.0,
                 stack_experts: bool = False):
        cls = transport_class("ray", transport, "RayEngine transport (--qrl-ray-weight-transport)")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"RayEngine backend {backend!r}: gloo or nccl (None: automatic)")
        self.actor = actor
        self.transport = transport
        backend = "gloo" if transport == "ipc" else backend or weight_backend(engine_kind)
        self.link = ActorLink(
            actor, call=lambda *a, **kw: self._call(*a, **kw), kill=self._kill,
            bucket_bytes=bucket_bytes, backend=backend, timeout_s=timeout_s,
            ipc_device=("cuda" if engine_kind == "sglang" and torch.cuda.is_available()
                        else "cpu"),
            abort_on_death=backend == "nccl")
        self.sender: WeightTransport = cls(self.link)
        self.stack_experts = stack_experts
        self._broken = False  # a broadcast failed: the actor was killed, never call it again

    # the link's fields, read and set as the proxy's own (tests and callers use these)
    bucket_bytes = property(lambda self: self.link.bucket_bytes,
                            lambda self, v: setattr(self.link, "bucket_bytes", v))
    backend = property(lambda self: self.link.backend)
    timeout_s = property(lambda self: self.link.timeout_s)
    ipc_device = property(lambda self: self.link.ipc_device)
    buckets_sent = property(lambda self: self.link.buckets_sent)
    group = property(lambda self: self.link.group,
                     lambda self, v: setattr(self.link, "group", v))
    group_name = property(lambda self: self.link.group_name,
                          lambda self, v: setattr(self.link, "group_name", v))
    abort_on_death = property(lambda self: self.link.abort_on_death,
                              lambda self, v: setattr(self.link, "abort_on_death", v))

    def _call(self, method: str, *args: Any, during: Callable[[Any], Any] | None = None) -> Any:
        """``actor.method(*args)``; ``during(ref)`` runs on the driver between submitting the
        call and waiting for it (the broadcast the actor receives)."""
        import ray

        try:
            ref = getattr(self.actor, method).remote(*args)
            if during is not None:
                during(ref)
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise EngineDiedError(f"rollout engine actor died during {method}: "
                                  f"{type(exc).__name__}: {str(exc)[:300]}") from exc

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self.stack_experts:  # before the one cut: the actor's engine keeps these buckets
            named_tensors = stack_experts(named_tensors)
        self.sender.send(named_tensors, version)

    def _kill(self) -> None:
        import ray

        self._broken = True
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def destroy_group(self) -> None:
        """Destroy the weight group on the driver (its peer may be dead; never raises)."""
        import torch.distributed as dist

        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - best effort: the group is unusable either way
            pass

    def held_checksums(self) -> dict[str, str]:
        return self._call("held_checksums")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        return self._call("generate", prompts, sampling)

    def weight_version(self) -> int:
        return self._call("weight_version")

    def capacity(self) -> EngineCapacity | None:
        return self._call("capacity")

    def release_memory(self) -> None:
        self._call("release_memory")

    def resume_memory(self) -> None:
        self._call("resume_memory")

    def call_log(self) -> list[str]:
        return self._call("call_log")

    def placement_group_id(self) -> str | None:
        return self._call("placement_group_id")

    def shutdown(self) -> None:
        if not self._broken:  # an actor stuck in a broken broadcast would never answer
            try:
                self._call("shutdown")
            except EngineDiedError:
                pass
        self._kill()
        self.destroy_group()

