"""SGLang serving LoRA adapters on top of its quantized base (``--qrl-lora-rank`` with
``--qrl-rollout-engine sglang``, single mode).

Read in the SGLang 0.5.17 wheel (``srt/entrypoints/engine.py``, ``srt/lora/*``,
``srt/managers/io_struct.py``, ``srt/managers/tp_worker.py``):

- the engine starts with ``enable_lora=True, max_lora_rank=r, lora_target_modules=[...]``
  (HF projection names; SGLang maps q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``) and
  wraps those layers in ``*WithLoRA`` modules that call the base layer's own quant method, so
  the base stays packed in the rollout format; with expert targets (``gate_up_proj`` +
  ``down_proj``) every ``FusedMoE`` is wrapped too, which for W4A16 needs
  ``moe_runner_backend="marlin"`` (:data:`EXPERT_LORA_MOE_RUNNER`) and, on the Marlin LoRA
  MoE runner (W4A16, NVFP4 on sm90), ``disable_cuda_graph=True``
  (:attr:`~megatron_qrl.rollout.lora_serving.LoraServing.eager_reason`; logged once at
  engine start). What the engine needs comes from the run's
  :class:`~megatron_qrl.rollout.lora_serving.LoraServing`, which decides it;
- ``LoadLoRAAdapterFromTensorsReqInput(lora_name, config_dict, serialized_named_tensors,
  load_format="flattened_bucket", expected_checksums={name: sha256})``: one flat CUDA buffer
  per TP rank; each scheduler process re-hashes what it deserialized and raises on any
  tensor missing, extra or different (``[LORA-CHECK]``; the scheduler dies, the engine call
  fails with :class:`~megatron_qrl.rollout.supervisor.EngineDiedError`). That is the
  engine-side receipt of an adapter sync (``SGLangOptions.receipt``);
- ``unload_lora_adapter(name)``: no upsert, so version ``v`` is loaded as ``policy_v<v>``
  and the previous adapter unloaded after the new one loaded; every generate request names
  the current adapter (``lora_path``).

The base (first sync, AQN's norm gains, merged tensors of ``rollout/lora_serving.py``'s
``merge`` path) goes through :meth:`SGLangEngine.update_weights` (the in-place loader
unwraps the LoRA layers while it loads: ``sync/loader/lora_wrappers.py``). Releasing GPU
memory between rollouts keeps the weights (kv cache and CUDA graphs only): the adapter
syncs never resend the base.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from ..rollout.base import WeightSyncError, tensor_checksum
from ..rollout.lora_serving import EXPERT_LORA_MOE_RUNNER, LoraServing
from . import crash
from .engine import SGLangEngine
from .options import SGLangOptions

__all__ = ["EXPERT_LORA_MOE_RUNNER", "RELEASE_TAGS", "SGLangLoraEngine", "adapter_name",
           "lora_engine_kwargs", "sha256_of"]

RELEASE_TAGS = ["kv_cache", "cuda_graph"]
"""What a LoRA engine frees between rollouts (SGLang's GPU_MEMORY_TYPE_* tags; not weights)."""


def adapter_name(version: int) -> str:
    """The served adapter's name for weight version ``version``."""
    return f"policy_v{version}"


def sha256_of(t: torch.Tensor) -> str:
    """The fingerprint SGLang's tp_worker takes of a received adapter tensor (sha256 of its
    bytes, ``detach().cpu().contiguous().flatten().view(torch.uint8)``)."""
    raw = t.detach().cpu().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


log = logging.getLogger(__name__)


def lora_engine_kwargs(rank: int, serving: LoraServing) -> dict:
    """``sglang.Engine`` arguments of LoRA serving (none when no target is served): the
    targets, the MoE runner and whether CUDA graphs stay on are ``serving``'s decisions
    (:attr:`~LoraServing.engine_targets`, :attr:`~LoraServing.moe_runner_backend`,
    :attr:`~LoraServing.eager_reason`)."""
    targets = list(serving.engine_targets)
    if not targets:
        return {}
    kw = {"enable_lora": True, "max_lora_rank": int(rank), "lora_target_modules": targets,
          "max_loras_per_batch": 1}  # SGLang's default LoRA backend (csgmv; MoE LoRA too)
    if serving.moe_runner_backend is not None:
        kw["moe_runner_backend"] = serving.moe_runner_backend
    if serving.eager_reason is not None:
        kw["disable_cuda_graph"] = True
    return kw


class SGLangLoraEngine(SGLangEngine):
    """:class:`SGLangEngine` + adapter-only updates (``rl/lora_sync.py``'s engine interface).

    ``lora_rank``: the adapters' rank; ``lora_serving``: the run's
    :func:`~megatron_qrl.rollout.lora_serving.resolve_lora_serving` for engine ``sglang`` and
    this ``spec_name`` (its ``engine_targets`` empty: every adapter is merged, the engine
    serves none)."""

    def __init__(self, model_path: Any, spec_name: str, options: SGLangOptions | None = None,
                 *, lora_rank: int, lora_serving: LoraServing, **kwargs: Any) -> None:
        if (lora_serving.engine, lora_serving.spec_name) != ("sglang", spec_name):
            raise ValueError(f"SGLangLoraEngine({spec_name!r}): lora_serving was resolved for "
                             f"engine {lora_serving.engine!r}, format {lora_serving.spec_name!r}"
                             f"; resolve it with resolve_lora_serving('sglang', {spec_name!r}, "
                             "...)")
        options = options if options is not None else SGLangOptions()
        options = options.replace(sync=options.sync_for(spec_name, lora=True))
        self.lora_targets = tuple(lora_serving.engine_targets)
        if lora_serving.eager_reason is not None:
            log.warning("SGLang LoRA engine (%s, routed-expert adapters): decode and prefill run "
                        "eager (disable_cuda_graph=True), slower than with CUDA graphs. %s",
                        spec_name, lora_serving.eager_reason)
        super().__init__(model_path, spec_name, options,
                         **(lora_engine_kwargs(lora_rank, lora_serving) | kwargs))
        self.lora_name: str | None = None
        self._lora_sent: dict[str, str] = {}

    def _request_kwargs(self, n: int) -> dict:
        return {} if self.lora_name is None else {"lora_path": [self.lora_name] * n}

    # ---- adapters ----------------------------------------------------------------------
    def _adapter_request(self, name: str, tensors: list[tuple[str, torch.Tensor]],
                         config: dict) -> tuple[Any, Any]:
        """The load request and the flat buffer it shares (kept alive until it is done)."""
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        bucket = FlattenedTensorBucket(named_tensors=tensors)
        data = {"flattened_tensor": bucket.get_flattened_tensor(),
                "metadata": bucket.get_metadata()}
        expected = ({n: sha256_of(t) for n, t in tensors} if self.options.receipt else None)
        return LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name, config_dict=dict(config), load_format="flattened_bucket",
            serialized_named_tensors=[MultiprocessingSerializer.serialize(data)
                                      for _ in range(self.processes)],
            expected_checksums=expected), data

    def _call(self, coro: Any) -> Any:
        with crash.engine_call():
            return self.engine.loop.run_until_complete(coro)

    def load_lora_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict,
                          version: int) -> None:
        """Load ``tensors`` (PEFT names) as adapter ``name``, name it in every request, then
        unload the previous adapter (SGLang has no upsert)."""
        if self._version < 0:
            raise WeightSyncError("load_lora_adapter() before the first update_weights(): the "
                                  "engine holds no base weights yet")
        if not self.lora_targets:
            raise WeightSyncError("load_lora_adapter() on an engine started without LoRA "
                                  "targets (every adapter of this run is merged)")
        t0 = time.perf_counter()
        named = [(k, v.detach().to(self.trainer_device)) for k, v in tensors.items()]
        req, flat = self._adapter_request(name, named, config)
        t1 = time.perf_counter()
        out = self._call(self.engine.tokenizer_manager.load_lora_adapter_from_tensors(req, None))
        del flat  # the engine has read the shared buffer
        if not getattr(out, "success", False):
            raise WeightSyncError(f"SGLang refused adapter {name!r}: "
                                  f"{getattr(out, 'error_message', out)}")
        t2 = time.perf_counter()
        old, self.lora_name = self.lora_name, name
        if old is not None and old != name:
            gone = self._call(self.engine.tokenizer_manager.unload_lora_adapter(
                _unload_request(old), None))
            if not getattr(gone, "success", False):
                raise WeightSyncError(f"SGLang did not unload adapter {old!r}: "
                                      f"{getattr(gone, 'error_message', gone)}")
        self._lora_sent = {k: tensor_checksum(v) for k, v in named}
        self._version = version
        self.last_sync = {"adapter": name, "tensors": len(named), "prepare_s": t1 - t0,
                          "load_s": t2 - t1, "unload_s": time.perf_counter() - t2,
                          "seconds": time.perf_counter() - t0,
                          "verified": "sha256" if req.expected_checksums else "none"}

    def held_lora_checksums(self) -> dict[str, str]:
        """Fingerprints (:func:`tensor_checksum`) of the adapter SGLang acknowledged; with
        ``receipt`` every scheduler process checked its sha256 of each tensor first."""
        return dict(self._lora_sent)

    def update_base_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                            version: int) -> None:
        """Unquantized base tensors (AQN's noisy norm gains) through the in-place sync."""
        self.update_weights(named_tensors, version)

    def update_packed_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                              version: int) -> None:
        """Packed tensors of some engine modules (the ``merge`` path: whole modules, q/k/v
        and gate/up together, every expert of a layer) through the in-place sync."""
        self.update_weights(named_tensors, version)

    # ---- memory --------------------------------------------------------------------------
    def release_memory(self) -> None:
        with crash.engine_call():
            self.engine.release_memory_occupation(tags=RELEASE_TAGS)

    def resume_memory(self) -> None:
        with crash.engine_call():
            self.engine.resume_memory_occupation(tags=RELEASE_TAGS)


def _unload_request(name: str) -> Any:
    from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

    return UnloadLoRAAdapterReqInput(lora_name=name)
