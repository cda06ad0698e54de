"""Transport ``direct`` (colocated, one engine process; the formats whose
:attr:`~megatron_qrl.quant.engine_facts.EngineFacts.direct_write` is set): the trainer's
weights are quantized straight into the engine's own tensors, cached codes and packed
tensors copied (:mod:`..writer`), through the handles of
:class:`~..storage_client.EngineStorage` — no buckets, no per-tensor requests, no post-load
processing; ``last_sync`` counts the weights ``quantized`` and the tensors ``copied``. Two
small requests per sync: the storage fingerprint before writing (handles re-taken where
SGLang moved a parameter) and the engine's read-back digest after, which also sets the
weight version; :meth:`DirectTransport.verify` compares the digest with the fingerprints
taken while writing, naming the layer of the first region that differs. An engine started
with its memory saver (``release_memory``) cannot hand its storage out: it is sent the stream
and writes it itself (:mod:`.direct_pull`; ``last_sync``: ``engine_writes``, ``buckets``
requests, ``write_s`` of which ``stream_s``). ``last_sync`` times
``storage_s`` (the fingerprint request / handles), ``write_s`` (the write, of which
``stream_s`` waited on the incoming stream: the trainer's weights produced, expert stacks
built) and ``digest_s``."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from megatron_qrl.sync.protocol.checksums import WeightSyncError
from megatron_qrl.sync.transport import WeightTransport, register_transport

from ..prefetch import timed
from ..session import SGLangSession
from ..storage_client import EngineStorage
from ..writer import Places, check_digest, writer_for
from .direct_pull import send_pulled

__all__ = ["WRITE_RANGE", "DirectTransport", "check_placement"]

WRITE_RANGE = "qrl.direct.write"
"""The profiler range of the write step (``write_s``: producing the stream, quantizing and
copying into the engine, fingerprints, the final device synchronize)."""


@register_transport("sglang", "direct")
class DirectTransport(WeightTransport):
    """Packed tensors written into the engine's storage (module docstring)."""

    def __init__(self, session: SGLangSession):
        self.s = session
        self.held: dict[str, str] | None = None

    def send(self, stream: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        s = self.s
        if s.storage is None:
            raise WeightSyncError("sync='direct' needs the engine's storage service "
                                  "(SGLangSession.storage)")
        if s.options.release_memory:  # the memory saver's storage: the engine writes it
            self.held = send_pulled(s, stream, version)
            return s.lap["buckets"]
        t0 = time.perf_counter()
        store = s.state.setdefault("storage", EngineStorage(s.storage))
        layout, tensors = store.current()
        t1 = time.perf_counter()
        writer = writer_for(s.spec, layout, tensors, s.sent,
                            store.derived.setdefault("places", Places()))
        parts: dict[str, float] = {}
        with torch.profiler.record_function(WRITE_RANGE):
            writer.write_all(timed(stream, parts, "stream_s"))
            if s.device.type == "cuda":
                torch.cuda.synchronize(s.device)  # the engine reads what this stream wrote
        t2 = time.perf_counter()
        out = s.storage({"what": "digest", "names": writer.shapes, "version": version})
        if out["fingerprint"] != layout.fingerprint:
            s.state.pop("storage", None)
            raise WeightSyncError("direct weight sync: the engine moved its parameters while "
                                  "they were written; the next sync takes new handles")
        self.held = out["digest"]
        s.lap.update(buckets=1, storage_s=t1 - t0, write_s=t2 - t1, **parts,
                     digest_s=time.perf_counter() - t2, handles_taken=store.taken,
                     quantized=writer.quantized, copied=writer.copied)
        return 1

    def send_bucket(self, item) -> int:  # the writer has no buckets (send is overridden)
        raise NotImplementedError

    def verify(self, sent: dict[str, str]) -> dict[str, str]:
        check_digest(sent, self.held or {})
        return dict(self.held or {})


def check_placement(trainer: torch.device, placement: dict) -> None:
    """``sync="direct"`` writes through CUDA IPC handles into one engine process holding
    the whole model (``placement``: the engine's ``tp_size`` / ``ep_size`` / ``pp_size`` /
    ``dp_size`` arguments)."""
    if trainer.type != "cuda":
        raise ValueError(f"--qrl-rollout-sglang-sync direct writes into the engine's GPU "
                         f"memory from the trainer's; got trainer_device={trainer}")
    gpu = int(placement.get("base_gpu_id", 0))
    if trainer.index is not None and trainer.index != gpu:
        raise ValueError(f"--qrl-rollout-sglang-sync direct writes into an engine on the "
                         f"trainer's GPU ({trainer}), this engine starts on cuda:{gpu} "
                         "(--qrl-rollout-sglang-base-gpu); use --qrl-rollout-sglang-sync "
                         "distributed for an engine on other GPUs")
    split = {k: int(placement.get(k, 1)) for k in ("tp_size", "ep_size", "pp_size", "dp_size")}
    split = {k: v for k, v in split.items() if v != 1}
    if split:
        said = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ValueError(f"--qrl-rollout-sglang-sync direct serves one engine process holding "
                         f"the whole model, this engine has {said}; use "
                         "--qrl-rollout-sglang-sync inplace")
