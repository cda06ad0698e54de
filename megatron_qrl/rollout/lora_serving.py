"""Which LoRA adapter tensors an engine serves as adapters, and which it gets merged.

Two ways to bring a LoRA policy (LoRA, Hu et al. 2021, eq. 3: ``W = W0 + (alpha/r) B A``) into
an engine that keeps a quantized base ``Q(W0)``:

- ``adapter``: the engine computes ``base(x) + (alpha/r) (x A^T) B^T`` with its base layer's own
  quant method and the adapter in 16 bit on the unquantized input; each sync sends only
  ``A`` and ``B`` (PEFT names).
- ``merge``: the trainer sends ``Q(deq(Q(W0)) + (alpha/r) B A)`` for the engine modules the
  adapter touches (q/k/v together, gate/up together, all experts of a layer), re-quantized
  with the rollout format and loaded in place like any weight sync.

What SGLang 0.5.17 serves (read in its wheel: ``srt/lora/layers.py``,
``srt/lora/lora_manager.py``, ``srt/layers/quantization/*``; GPU runs: tests/gpu/
test_sglang_lora.py):

- attention and dense-MLP projections: ``ColumnParallelLinearWithLoRA`` /
  ``RowParallelLinearWithLoRA`` call ``base_layer.quant_method.apply`` and add the adapter,
  for every quant method -> ``adapter`` in every format.
- routed experts: ``FusedMoEWithLoRA`` needs a Triton MoE runner (``get_triton_quant_info``:
  unquantized, w8a8_int8, w8a8_fp8) or Marlin with compressed-tensors / ModelOpt NVFP4
  (``get_marlin_quant_info``); any other runner raises ``LoRA MoE not supported for
  backend``. ``fp8`` block quantization (our ``fp8_block``) picks DeepGEMM on Hopper ->
  ``merge``; ModelOpt NVFP4 runs on Marlin on sm80-sm9x (``adapter``) but on FlashInfer
  TRT-LLM on Blackwell (``merge``).
- SGLang wraps a layer's ``FusedMoE`` as soon as ``gate_up_proj`` and ``down_proj`` are
  LoRA targets, so on a MoE model the dense-MLP projections go by the experts' verdict
  (a MoE model without expert adapters: ``merge`` for any dense-MLP adapter, the engine's
  targets hold attention only).

The reference engine (``rollout/lora_adapters.py``) serves adapters on ``nn.Linear`` layers
(attention, dense MLP, shared experts); routed experts (fused 3-D parameters) are merged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..quant.hf_names import parse
from .lora_adapters import PEFT_PREFIX

__all__ = ["ATTENTION", "EXPERT_SERVING", "LoraServing", "hf_weight_of", "resolve_lora_serving"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_HOPPER = (9, 0)

EXPERT_SERVING: dict[str, str] = {
    "bf16": "adapter",       # UnquantizedFusedMoEMethod, Triton runner
    "int8": "adapter",       # w8a8_int8: Triton runner
    "fp8": "adapter",        # w8a8_fp8: Triton runner
    "fp8_block": "merge",    # fp8 (block): DeepGEMM runner on Hopper, no LoRA
    "w4a16": "adapter",      # compressed-tensors WNA16 MoE: Marlin
    "nvfp4": "adapter",      # ModelOpt NVFP4: Marlin on sm80-sm9x (merge on Blackwell)
}
"""SGLang 0.5.17, routed-expert adapters per rollout format on the H200 (module doc)."""


def hf_weight_of(peft: str) -> str:
    """``base_model.model.<m>.lora_A.weight`` -> ``<m>.weight`` (the base weight it adapts)."""
    body = peft.removeprefix(PEFT_PREFIX)
    for tail in (".lora_A.weight", ".lora_B.weight"):
        if body.endswith(tail):
            return body[: -len(tail)] + ".weight"
    raise ValueError(f"{peft!r} is not a PEFT LoRA tensor name "
                     f"({PEFT_PREFIX}<module>.lora_A.weight / lora_B.weight)")


@dataclass(frozen=True)
class LoraServing:
    """The resolved serving of one run's adapters (:func:`resolve_lora_serving`)."""

    engine: str
    spec_name: str
    attention: str
    dense_mlp: str
    experts: str
    """``adapter`` | ``merge``; ``none`` without routed-expert adapters."""
    engine_targets: tuple[str, ...]
    """HF projections the engine is started with as LoRA targets (SGLang
    ``lora_target_modules``); empty: the engine needs no LoRA support."""

    def path_of(self, peft: str) -> str:
        """``adapter`` or ``merge`` for one adapter tensor (PEFT name)."""
        p = parse(hf_weight_of(peft))
        if p is None:
            raise ValueError(f"adapter tensor {peft!r} does not adapt a projection")
        return {"attention": self.attention, "experts": self.experts}.get(p.kind, self.dense_mlp)

    def split(self, tensors: Mapping) -> tuple[dict, dict]:
        """``(adapter tensors, tensors to merge)`` of a PEFT-named adapter state."""
        served, merged = {}, {}
        for name, t in tensors.items():
            (served if self.path_of(name) == "adapter" else merged)[name] = t
        return served, merged

    @property
    def merges(self) -> bool:
        return "merge" in (self.attention, self.dense_mlp, self.experts)


def resolve_lora_serving(engine: str, spec_name: str, targets: Iterable[str], *,
                         is_moe: bool, experts: bool,
                         capability: tuple[int, int] | None = None) -> LoraServing:
    """Which path each adapter of a run takes (module doc). ``engine``: ``reference`` or
    ``sglang``; ``spec_name``: the rollout format; ``targets``: ``--qrl-lora-targets``;
    ``capability``: the engine GPU's compute capability (None: the H200, sm90)."""
    targets = tuple(targets)
    if engine == "reference":
        return LoraServing(engine, spec_name, "adapter", "adapter",
                           "merge" if is_moe and experts else "none", targets)
    if engine != "sglang":
        raise ValueError(f"LoRA serving: unknown engine {engine!r} (reference | sglang)")
    if spec_name not in EXPERT_SERVING:
        raise ValueError(f"LoRA serving: format {spec_name!r} is not in EXPERT_SERVING "
                         f"({', '.join(EXPERT_SERVING)}); add its SGLang verdict there")
    expert = EXPERT_SERVING[spec_name]
    if spec_name == "nvfp4" and (capability or _HOPPER) >= (10, 0):
        expert = "merge"  # ModelOpt NVFP4 MoE on Blackwell: FlashInfer TRT-LLM runner
    dense = "adapter" if not is_moe or (experts and expert == "adapter") else "merge"
    served = [t for t in targets if t in ATTENTION or (t in _MLP and dense == "adapter")]
    return LoraServing(engine, spec_name, "adapter", dense,
                       expert if is_moe and experts else "none", tuple(served))
