"""A rollout engine in a Ray actor, behind the same :class:`RolloutEngine` interface.

:class:`EngineActor` (run as ``ray.remote``) builds the engine inside the actor process —
the reference engine, or lazily SGLang's (one GPU per actor) — and :class:`RayEngine` is the driver-side proxy
whose methods call the actor. Weight sync is the single-process path unchanged: the packed
``(hf_name, tensor)`` stream is cut into buckets (lists of ``(name, tensor)``, about
``bucket_bytes`` each), every bucket is ``ray.put`` into the object store as it fills, and
the actor loads the stream bucket by bucket from the ObjectRefs; ``verify`` then compares the
actor's ``held_checksums`` with the sender's :class:`WeightManifest` exactly as in single
mode. Tensors of the 1-byte float dtypes (FP8 / NVFP4 codes and scales) travel as their
``uint8`` bytes plus the dtype (:class:`WireTensor`): torch's pickler cannot round-trip them
(measured with torch 2.13: ``pickle.loads(pickle.dumps(float8 tensor))`` fails in
``_legacy_load`` on ``UntypedStorage.dtype``), and Ray pickles what it stores. A dead actor (``RayActorError`` / ``ActorDiedError``) surfaces as
:class:`EngineDiedError`, which :class:`EngineSupervisor` restarts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from .base import GenerationOutput, RolloutEngine, SamplingParams
from .supervisor import EngineDiedError

__all__ = ["SGLANG_ROLLOUT_FIELDS", "EngineActor", "EngineSpec", "RayEngine", "WireTensor",
           "bucketize", "build_engine", "from_wire", "sglang_job_spec", "to_wire"]

_PICKLE_SAFE_1B = (torch.uint8, torch.int8, torch.bool)


@dataclass(frozen=True)
class WireTensor:
    """A tensor the object store cannot hold as is: its raw bytes and its dtype's name."""

    data: torch.Tensor
    dtype: str


def to_wire(t: torch.Tensor) -> torch.Tensor | WireTensor:
    """``t`` on the driver's CPU, in a form Ray can pickle (see the module docstring)."""
    t = t.detach().cpu()
    if t.element_size() == 1 and t.dtype not in _PICKLE_SAFE_1B:
        return WireTensor(t.contiguous().view(torch.uint8), str(t.dtype).removeprefix("torch."))
    return t


def from_wire(t: torch.Tensor | WireTensor) -> torch.Tensor:
    """Undo :func:`to_wire`."""
    return t.data.view(getattr(torch, t.dtype)) if isinstance(t, WireTensor) else t


SGLANG_ROLLOUT_FIELDS = ("sglang_sync", "sglang_mem_fraction", "sglang_sync_dir")
"""The :class:`~megatron_qrl.config.run.RolloutConfig` fields ``start_job_engine`` reads."""


@dataclass(frozen=True)
class EngineSpec:
    """What the actor builds: ``kind`` ``reference`` (transformers, CPU) or ``sglang``.

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
    sglang_kwargs: dict = field(default_factory=dict)
    """Extra ``SGLangEngine`` keyword arguments for kind ``sglang``; with ``model_path`` the
    engine starts from that HF checkpoint directory instead of the job's config-only one."""
    rollout: dict = field(default_factory=dict)
    """Kind ``sglang`` job engine: the :data:`SGLANG_ROLLOUT_FIELDS` of the job's
    ``RolloutConfig`` (sync mode, memory fraction, sync directory)."""

    def __post_init__(self) -> None:
        if self.kind not in ("reference", "sglang"):
            raise ValueError(f"EngineSpec.kind must be 'reference' or 'sglang', got {self.kind!r}")
        unknown = set(self.rollout) - set(SGLANG_ROLLOUT_FIELDS)
        if unknown:
            raise ValueError(f"EngineSpec.rollout: unknown field(s) {sorted(unknown)}; the "
                             f"fields are {SGLANG_ROLLOUT_FIELDS}")
        tp = int(self.sglang_kwargs.get("tp_size", 1))
        if self.kind == "sglang" and tp != 1:
            raise ValueError(
                f"EngineSpec(kind='sglang', tp_size={tp}): a Ray engine actor holds one GPU "
                "(one SGLang engine per actor, TP 1) in this build; drop tp_size or run "
                "--qrl-mode single, whose in-process engine may use TP > 1")

    @property
    def num_gpus(self) -> int:
        """GPUs the actor asks Ray for: 1 for an SGLang engine (TP 1), 0 for the reference."""
        return 1 if self.kind == "sglang" else 0


def sglang_job_spec(rollout_cfg: Any, hf_config: dict, seed: int,
                    num_threads: int | None = None) -> EngineSpec:
    """The :class:`EngineSpec` of ``--qrl-rollout-engine sglang`` (``rollout_cfg``: a
    ``RolloutConfig``): the arguments :func:`~megatron_qrl.rollout_sglang.launch.start_job_engine`
    takes in single mode."""
    return EngineSpec("sglang", dict(hf_config), rollout_cfg.format, seed, num_threads=num_threads,
                      rollout={k: getattr(rollout_cfg, k) for k in SGLANG_ROLLOUT_FIELDS
                               if hasattr(rollout_cfg, k)})


def build_engine(spec: EngineSpec) -> RolloutEngine:
    """The engine named by ``spec`` (imports SGLang only when asked for it)."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    if spec.kind == "reference":
        from .reference import ReferenceEngine

        return ReferenceEngine(spec.hf_config, spec.format, device="cpu", dtype=torch.float32,
                               seed=spec.seed)
    kwargs = dict(spec.sglang_kwargs)
    if "model_path" not in kwargs:
        from megatron_qrl.rollout_sglang.launch import start_job_engine

        cfg = SimpleNamespace(format=spec.format, **spec.rollout)
        return start_job_engine(cfg, spec.hf_config, spec.seed, **kwargs)
    from megatron_qrl.rollout_sglang.engine import SGLangEngine

    return SGLangEngine(kwargs.pop("model_path"), spec.format, **kwargs)


class EngineActor:
    """The actor body: owns one engine, built at construction inside the actor process."""

    def __init__(self, spec: EngineSpec):
        self.engine = build_engine(spec)
        self.calls: list[str] = []

    def update_weights(self, bucket_refs: list[Any], version: int) -> None:
        import ray

        self.calls.append("update_weights")

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for ref in bucket_refs:
                for name, t in ray.get(ref):
                    yield name, from_wire(t)

        self.engine.update_weights(stream(), version)

    def held_checksums(self) -> dict[str, str]:
        return self.engine.held_checksums()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        self.calls.append("generate")
        return self.engine.generate(prompts, sampling)

    def weight_version(self) -> int:
        return self.engine.weight_version()

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


def bucketize(stream: Iterable[tuple[str, torch.Tensor]],
              bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor | WireTensor]]]:
    """Group ``stream`` into lists of about ``bucket_bytes`` (a larger tensor is its own
    bucket), each tensor in its :func:`to_wire` form."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in stream:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, to_wire(t)))
        size += nbytes
    if bucket:
        yield bucket


class RayEngine(RolloutEngine):
    """Driver-side proxy of an :class:`EngineActor` handle (``actor``)."""

    def __init__(self, actor: Any, bucket_bytes: int = 256 * 2**20):
        self.actor = actor
        self.bucket_bytes = bucket_bytes
        self.buckets_sent = 0

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise EngineDiedError(f"rollout engine actor died during {method}: "
                                  f"{type(exc).__name__}: {str(exc)[:300]}") from exc

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        import ray

        refs = [ray.put(b) for b in bucketize(named_tensors, self.bucket_bytes)]
        self.buckets_sent += len(refs)
        self._call("update_weights", refs, version)

    def held_checksums(self) -> dict[str, str]:
        return self._call("held_checksums")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        return self._call("generate", prompts, sampling)

    def weight_version(self) -> int:
        return self._call("weight_version")

    def release_memory(self) -> None:
        self._call("release_memory")

    def resume_memory(self) -> None:
        self._call("resume_memory")

    def call_log(self) -> list[str]:
        return self._call("call_log")

    def placement_group_id(self) -> str | None:
        return self._call("placement_group_id")

    def shutdown(self) -> None:
        import ray

        try:
            self._call("shutdown")
        except EngineDiedError:
            pass
        ray.kill(self.actor, no_restart=True)

