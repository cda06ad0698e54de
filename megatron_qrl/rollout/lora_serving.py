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
  ``merge``; ModelOpt NVFP4 runs on Marlin on sm80-sm9x but on FlashInfer TRT-LLM on
  Blackwell (``merge``). The Marlin LoRA runner (``srt/lora/lora_moe_runner_marlin.py``
  ``MarlinLoraRunnerCore``: ``assert ... get_device_capability(...)[0] >= 9``, "requires CUDA
  compute capability >= 9") leaves sm80-sm89 to ``merge`` for both Marlin formats.
  ``FusedMoEWithLoRA`` reads the runner off ``base_layer.quant_method.runner``, which
  compressed-tensors keeps on its scheme, so a W4A16 model on the default
  ``moe_runner_backend="auto"`` falls back to Triton and fails on the Marlin WNA16 scheme's
  missing ``get_triton_quant_info``: :class:`~megatron_qrl.rollout_sglang.lora.
  SGLangLoraEngine` starts such an engine with ``moe_runner_backend="marlin"``.
- SGLang wraps a layer's ``FusedMoE`` as soon as ``gate_up_proj`` and ``down_proj`` are
  LoRA targets, so on a MoE model the dense-MLP projections (dense layers, shared experts)
  go by the experts' verdict (a MoE model without expert adapters: ``merge`` for any
  dense-MLP adapter, the engine's targets hold attention only).

A path with no adapter tensors is ``none`` (attention without attention targets, the dense
MLP without gate/up/down targets or on a model without dense-MLP projections, the experts
without ``--qrl-lora-experts``), so :attr:`LoraServing.merges` says whether anything is
merged at all; :meth:`LoraServing.path_of` refuses a tensor on a ``none`` path.

The reference engine (``rollout/lora_adapters.py``) serves adapters on ``nn.Linear`` layers
(attention, dense MLP, shared experts); routed experts (fused 3-D parameters) are merged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..quant.hf_names import parse
from .lora_adapters import PEFT_PREFIX

__all__ = ["ATTENTION", "EXPERT_SERVING", "LoraServing", "expert_path", "hf_weight_of",
           "resolve_lora_serving"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_HOPPER = (9, 0)
_MARLIN_LORA_MIN = (9, 0)
"""``MarlinLoraRunnerCore``'s minimum compute capability (module doc)."""

EXPERT_SERVING: dict[str, str] = {
    "bf16": "adapter",       # UnquantizedFusedMoEMethod, Triton runner
    "int8": "adapter",       # w8a8_int8: Triton runner
    "fp8": "adapter",        # w8a8_fp8: Triton runner
    "fp8_block": "merge",    # fp8 (block): DeepGEMM runner on Hopper, no LoRA
    "w4a16": "adapter",      # compressed-tensors WNA16 MoE: Marlin (moe_runner_backend=marlin)
    "nvfp4": "adapter",      # ModelOpt NVFP4: Marlin on sm90 (merge on Blackwell)
}
"""SGLang 0.5.17, routed-expert adapters per rollout format on the H200 (module doc; the
Marlin formats merge below sm90, NVFP4 also on sm100+: :func:`expert_path`)."""
_MARLIN = ("w4a16", "nvfp4")


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
    """The resolved serving of one run's adapters (:func:`resolve_lora_serving`); each path
    is ``adapter`` | ``merge`` | ``none`` (the run has no adapter tensors there)."""

    engine: str
    spec_name: str
    attention: str
    dense_mlp: str
    experts: str
    engine_targets: tuple[str, ...]
    """HF projections the engine is started with as LoRA targets (SGLang
    ``lora_target_modules``); empty: the engine needs no LoRA support."""

    def path_of(self, peft: str) -> str:
        """``adapter`` or ``merge`` for one adapter tensor (PEFT name)."""
        p = parse(hf_weight_of(peft))
        if p is None:
            raise ValueError(f"adapter tensor {peft!r} does not adapt a projection")
        kind = p.kind if p.kind in ("attention", "experts") else "dense_mlp"
        path = getattr(self, kind)
        if path == "none":
            raise ValueError(f"adapter tensor {peft!r} adapts a {p.kind} projection, but this "
                             f"run's LoRA serving has none ({self}); resolve_lora_serving was "
                             "given other targets / model structure than the trainer's")
        return path

    def split(self, tensors: Mapping) -> tuple[dict, dict]:
        """``(adapter tensors, tensors to merge)`` of a PEFT-named adapter state."""
        served, merged = {}, {}
        for name, t in tensors.items():
            (served if self.path_of(name) == "adapter" else merged)[name] = t
        return served, merged

    @property
    def merges(self) -> bool:
        """Some adapter tensor of the run is merged into the engine's base."""
        return "merge" in (self.attention, self.dense_mlp, self.experts)


def expert_path(spec_name: str, capability: tuple[int, int] | None = None) -> str:
    """SGLang's routed-expert LoRA verdict for a format on a GPU (None: the H200, sm90)."""
    if spec_name not in EXPERT_SERVING:
        raise ValueError(f"LoRA serving: format {spec_name!r} is not in EXPERT_SERVING "
                         f"({', '.join(EXPERT_SERVING)}); add its SGLang verdict there")
    cap = capability or _HOPPER
    if spec_name in _MARLIN and cap < _MARLIN_LORA_MIN:
        return "merge"  # MarlinLoraRunnerCore: compute capability >= 9
    if spec_name == "nvfp4" and cap >= (10, 0):
        return "merge"  # ModelOpt NVFP4 MoE on Blackwell: FlashInfer TRT-LLM runner
    return EXPERT_SERVING[spec_name]


def resolve_lora_serving(engine: str, spec_name: str, targets: Iterable[str], *,
                         is_moe: bool, experts: bool,
                         capability: tuple[int, int] | None = None,
                         dense_mlp: bool | None = None) -> LoraServing:
    """Which path each adapter of a run takes (module doc). ``engine``: ``reference`` or
    ``sglang``; ``spec_name``: the rollout format; ``targets``: ``--qrl-lora-targets``;
    ``experts``: ``--qrl-lora-experts``; ``capability``: the engine GPU's compute capability
    (None: the H200, sm90); ``dense_mlp``: the model has non-expert MLP projections (dense
    layers, shared experts; None: a dense model has, a MoE model has not — the MoE
    architectures of ``models/hf_config.py`` have neither)."""
    targets = tuple(targets)
    mlp = [t for t in targets if t in _MLP]
    if experts and is_moe and set(mlp) != set(_MLP):
        raise ValueError(f"LoRA serving: expert adapters need gate_proj, up_proj and down_proj "
                         f"targets (got {', '.join(targets)}): SGLang wraps FusedMoE only with "
                         "both gate_up and down")
    has_dense = (not is_moe) if dense_mlp is None else dense_mlp
    attention = "adapter" if any(t in ATTENTION for t in targets) else "none"
    if engine == "reference":
        return LoraServing(engine, spec_name, attention,
                           "adapter" if mlp and has_dense else "none",
                           "merge" if is_moe and experts else "none", targets)
    if engine != "sglang":
        raise ValueError(f"LoRA serving: unknown engine {engine!r} (reference | sglang)")
    expert = expert_path(spec_name, capability) if is_moe and experts else "none"
    if not (mlp and has_dense):
        dense = "none"
    else:  # on a MoE model SGLang's MLP targets wrap FusedMoE too (module doc)
        dense = "adapter" if not is_moe or expert == "adapter" else "merge"
    mlp_served = "adapter" in (dense, expert)
    served = [t for t in targets if t in ATTENTION or (t in _MLP and mlp_served)]
    return LoraServing(engine, spec_name, attention, dense, expert, tuple(served))
