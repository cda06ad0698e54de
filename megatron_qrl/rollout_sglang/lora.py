"""SGLang serving LoRA adapters on top of its quantized base — GPU-UNTESTED, not wired yet.

Written against the SGLang 0.5.17 wheel (read, not run): ``sglang.Engine(enable_lora=True,
max_lora_rank=r, lora_target_modules=[...], max_loras_per_batch=n)``;
``Engine.load_lora_adapter_from_tensors(lora_name, tensors, config_dict, load_format=None)``
(PEFT names; ``LoRAAdapter._process_weight`` parses ``layers.<i>`` and stacks q/k/v and
gate/up itself); ``Engine.unload_lora_adapter(lora_name)``; ``generate(..., lora_path=[name,
...])`` names the adapter per request. There is no upsert, so version ``v`` is loaded under a
new name and the previous one unloaded afterwards. Dense LoRA wraps the base layer's own quant
method (fp8, w8a8, Marlin, modelopt_fp4 pass through), so the base stays packed in the engine.

The driver refuses ``--qrl-lora-rank`` with ``--qrl-rollout-engine sglang``
(``config/lora_checks.py``) until this class has run on the H200 (tests/gpu, to be written).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from megatron_qrl.rollout.base import WeightSyncError, tensor_checksum
from megatron_qrl.rollout_sglang.engine import SGLangEngine

__all__ = ["SGLangLoraEngine"]


class _NamedAdapter:
    """Proxy of ``sglang.Engine`` whose ``generate`` names the served adapter per request."""

    def __init__(self, engine: Any, owner: SGLangLoraEngine) -> None:
        self._engine, self._owner = engine, owner

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        name = self._owner.lora_name
        if name is not None:
            kwargs.setdefault("lora_path", [name] * len(kwargs.get("input_ids") or []))
        return self._engine.generate(*args, **kwargs)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._engine, item)


class SGLangLoraEngine(SGLangEngine):
    """:class:`SGLangEngine` + adapter-only updates (``rl/lora_sync.py``'s engine interface)."""

    def __init__(self, model_path: Any, spec_name: str, *, lora_rank: int,
                 lora_targets: Iterable[str], max_loras_per_batch: int = 2,
                 **kwargs: Any) -> None:
        kwargs.update(enable_lora=True, max_lora_rank=int(lora_rank),
                      lora_target_modules=list(lora_targets),
                      max_loras_per_batch=max_loras_per_batch)
        super().__init__(model_path, spec_name, **kwargs)
        self.engine = _NamedAdapter(self.engine, self)
        self.lora_name: str | None = None
        self._lora_sent: dict[str, str] = {}

    def load_lora_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict,
                          version: int) -> None:
        """Load ``tensors`` (PEFT names) as adapter ``name``, then unload the previous one."""
        if self._version < 0:
            raise WeightSyncError("load_lora_adapter() before the first update_weights()")
        sent = {k: tensor_checksum(v) for k, v in tensors.items()}
        device = self.trainer_device
        out = self.engine.load_lora_adapter_from_tensors(
            name, {k: v.to(device) for k, v in tensors.items()}, dict(config))
        if not getattr(out, "success", True):
            raise WeightSyncError(f"SGLang refused adapter {name!r}: "
                                  f"{getattr(out, 'error_message', out)}")
        old, self.lora_name = self.lora_name, name
        if old is not None and old != name:
            self.engine.unload_lora_adapter(old)
        self._lora_sent, self._version = sent, version

    def held_lora_checksums(self) -> dict[str, str]:
        """Fingerprints of the adapter SGLang acknowledged (of the tensors it was handed)."""
        return dict(self._lora_sent)

    def update_base_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                            version: int) -> None:
        """Unquantized base tensors (AQN's noisy norm gains) through SGLang's tensor update."""
        named = [(n, t.to(self.trainer_device)) for n, t in named_tensors]
        out = self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=True)
        ok = out[0] if isinstance(out, tuple) else getattr(out, "success", True)
        if not ok:
            raise WeightSyncError(f"SGLang refused the norm update: {out}")
        self._version = version
