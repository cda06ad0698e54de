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
  missing ``get_triton_quant_info``: such an engine starts with
  ``moe_runner_backend="marlin"`` (:data:`EXPERT_LORA_MOE_RUNNER`).
- routed-expert adapters on the Marlin LoRA runner (``w4a16``; ``nvfp4`` on sm90) start the
  engine without CUDA graphs (:attr:`LoraServing.eager_reason`): SGLang allocates the MoE-LoRA
  CUDA-graph buffers from ``_quant_info.w13_weight``, which the Marlin quant info lacks.
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

from ..quant import get_spec, list_specs
from ..utils.hf_names import parse
from .lora_adapters import PEFT_PREFIX

__all__ = ["ATTENTION", "EXPERT_LORA_MOE_RUNNER", "EXPERT_SERVING", "LoraServing", "expert_path",
           "hf_weight_of", "resolve_lora_serving"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_HOPPER = (9, 0)
_MARLIN_LORA_MIN = (9, 0)
"""``MarlinLoraRunnerCore``'s minimum compute capability (module doc)."""

EXPERT_SERVING: dict[str, str] = {name: get_spec(name).engine.lora_experts
                                   for name in list_specs()}
"""SGLang 0.5.17, routed-expert adapters per rollout format on the H200, as each format
declares it (:attr:`megatron_qrl.quant.engine_facts.EngineFacts.lora_experts`; the Marlin
formats merge below sm90, NVFP4 also on sm100+: :func:`expert_path`)."""

EXPERT_LORA_MOE_RUNNER = {name: get_spec(name).engine.lora_moe_runner for name in list_specs()
                          if get_spec(name).engine.lora_moe_runner is not None}
"""``moe_runner_backend`` of an engine serving routed-expert adapters, per rollout format
where SGLang 0.5.17's default (``auto``) cannot: ``FusedMoEWithLoRA.__init__``
(``srt/lora/layers.py``) takes the LoRA runner from ``base_layer.quant_method.runner``, which
``CompressedTensorsFusedMoEMethod`` lacks (its scheme holds it), so ``auto`` means Triton,
and ``get_triton_quant_info`` of the Marlin ``CompressedTensorsWNA16MoE`` scheme does not
exist (``compressed_tensors_wNa16_moe.py``: only ``get_marlin_quant_info``). With
``marlin`` SGLang still picks that scheme for the base (``compressed_tensors.py``: only
``triton`` picks ``CompressedTensorsWNA16TritonMoE``) and the LoRA layer takes its
``get_marlin_quant_info`` (``MarlinLoraRunnerCore``). ModelOpt NVFP4 needs nothing: its
method keeps ``runner`` (Marlin on sm80-sm9x)."""

MARLIN_EXPERT_LORA_EAGER = (
    "SGLang 0.5.17 cannot start routed-expert LoRA on the Marlin MoE runner with CUDA graphs: "
    "model_runner.py init_lora_manager (line 1168, run unless CUDA graphs are fully disabled) "
    "pre-allocates the MoE-LoRA CUDA-graph buffers from _quant_info.w13_weight "
    "(lora/backend/base_backend.py line 222), and the Marlin quant info has w13_qweight only "
    "(AttributeError at engine start)")
"""Why :attr:`LoraServing.eager_reason` disables CUDA graphs (the engine logs it)."""


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

    # ---- what the SGLang engine needs (rollout_sglang/lora.py::lora_engine_kwargs) --------
    @property
    def wraps_experts(self) -> bool:
        """SGLang wraps every ``FusedMoE`` in ``FusedMoEWithLoRA``: routed-expert adapters are
        served, so :attr:`engine_targets` hold gate/up/down on a MoE model (module doc)."""
        return self.engine == "sglang" and self.experts == "adapter"

    @property
    def moe_runner_backend(self) -> str | None:
        """The engine's ``moe_runner_backend`` (:data:`EXPERT_LORA_MOE_RUNNER`; None: SGLang's
        own choice)."""
        return get_spec(self.spec_name).engine.lora_moe_runner if self.wraps_experts else None

    @property
    def eager_reason(self) -> str | None:
        """Why the engine must start with ``disable_cuda_graph=True`` (None: CUDA graphs on).

        SGLang 0.5.17, ``srt/model_executor/model_runner.py`` ``init_lora_manager`` (~1150-1175)
        calls ``init_lora_cuda_graph_moe_buffers`` unless ``cuda_graph_fully_disabled()``
        (``cuda_graph_config.py``: decode AND prefill graphs off; LoRA keeps the breakable
        prefill graph on by default, so only ``disable_cuda_graph`` turns both off); that
        reads ``FusedMoEWithLoRA._quant_info.w13_weight`` (``srt/lora/backend/base_backend.py``
        ``init_cuda_graph_moe_buffers`` line 222), and on the Marlin LoRA path
        (``srt/lora/layers.py`` ``FusedMoEWithLoRA.__init__``: ``get_marlin_quant_info``; also
        ``lora/marlin_lora_temp``) it is a ``MarlinMoeQuantInfo`` (``w13_qweight``). Eagerly,
        nothing else on that path reads ``w13_weight`` or the CUDA-graph buffers:
        ``_get_lora_info`` takes ``moe_cg_buffers`` with ``getattr(..., None)``,
        ``lora_moe_runners.py`` uses them only under ``get_is_capture_mode()`` and
        ``base_backend._add_moe_lora_info`` only for ``batch_info.use_cuda_graph`` batches
        (``lora_manager.prepare_lora_batch``: only after a decode graph runner set
        ``max_bs_in_cuda_graph``); ``MarlinLoraRunnerCore`` reads ``w13_qweight``."""
        if self.wraps_experts and get_spec(self.spec_name).engine.lora_marlin:
            return MARLIN_EXPERT_LORA_EAGER
        return None


def expert_path(spec_name: str, capability: tuple[int, int] | None = None) -> str:
    """SGLang's routed-expert LoRA verdict for a format on a GPU (None: the H200, sm90)."""
    if spec_name not in list_specs():
        raise ValueError(f"LoRA serving: format {spec_name!r} is not a registered format "
                         f"({', '.join(list_specs())})")
    facts = get_spec(spec_name).engine
    cap = capability or _HOPPER
    if facts.lora_marlin and cap < _MARLIN_LORA_MIN:
        return "merge"  # MarlinLoraRunnerCore: compute capability >= 9
    if facts.lora_merge_from is not None and cap >= facts.lora_merge_from:
        return "merge"  # e.g. ModelOpt NVFP4 MoE on Blackwell: FlashInfer TRT-LLM runner
    return facts.lora_experts


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
