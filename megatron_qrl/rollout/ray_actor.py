"""A rollout engine in a Ray actor, behind the same :class:`RolloutEngine` interface.

:class:`EngineActor` (run as ``ray.remote``) builds the engine inside the actor process —
the reference engine, or lazily SGLang's — and :class:`RayEngine` is the driver-side proxy
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
from typing import Any

import torch

from .base import GenerationOutput, RolloutEngine, SamplingParams
from .supervisor import EngineDiedError

__all__ = ["EngineActor", "EngineSpec", "RayEngine", "WireTensor", "bucketize", "from_wire",
           "to_wire"]

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


@dataclass(frozen=True)
class EngineSpec:
    """What the actor builds: ``kind`` ``reference`` (transformers, CPU) or ``sglang``."""

    kind: str
    hf_config: dict
    format: str
    seed: int = 0
    num_threads: int | None = None
    """torch intra-op threads in the actor (None: Ray's default); the driver passes its own
    so CPU results match single mode bit for bit."""
    sglang_kwargs: dict = field(default_factory=dict)
    """``SGLangEngine(**sglang_kwargs)`` for kind ``sglang`` (``model_path`` at least)."""

    def __post_init__(self) -> None:
        if self.kind not in ("reference", "sglang"):
            raise ValueError(f"EngineSpec.kind must be 'reference' or 'sglang', got {self.kind!r}")
        if self.kind == "sglang" and "model_path" not in self.sglang_kwargs:
            raise ValueError("EngineSpec(kind='sglang') needs sglang_kwargs['model_path'] (the "
                             "HF checkpoint directory SGLang starts from)")


def build_engine(spec: EngineSpec) -> RolloutEngine:
    """The engine named by ``spec`` (imports SGLang only when asked for it)."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    if spec.kind == "reference":
        from .reference import ReferenceEngine

        return ReferenceEngine(spec.hf_config, spec.format, device="cpu", dtype=torch.float32,
                               seed=spec.seed)
    from megatron_qrl.rollout_sglang.engine import SGLangEngine

    kwargs = dict(spec.sglang_kwargs)
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

