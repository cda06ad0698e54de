"""What the engines do with a format, declared on the format (``QuantSpec.engine``).

A format's numerics (:mod:`.spec_core`) say what the rollout computes; these facts say which
engine paths were measured to carry it: the SGLang weight-sync paths, the Transformer Engine
recipe that could serve its aligned forward, the flags SGLang's Triton fused-MoE kernel runs
it with, and how SGLang serves routed-expert LoRA adapters over it. Every registered format
declares one :class:`EngineFacts` (:func:`~megatron_qrl.quant.spec.register_spec` refuses a
format without), and the engines read the facts from the registry: a new format is one file
under :mod:`.formats` plus its tests.

Plain data only (no SGLang or TE import): the consumers are
:mod:`megatron_qrl.rollout_sglang.options` (sync paths),
:mod:`megatron_qrl.te_quant.te_recipes` (TE recipes),
:mod:`megatron_qrl.rollout_sglang.kernels.moe_tune` (kernel flags) and
:mod:`megatron_qrl.rollout.lora_serving` (LoRA serving).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["EXPERT_LORA_PATHS", "SYNC_MODES", "EngineFacts", "KernelFlags", "TERecipe"]

SYNC_MODES = ("inplace", "tensor", "disk", "distributed", "direct")
"""SGLang's weight-sync paths (``--qrl-rollout-sglang-sync``, besides ``auto``)."""
EXPERT_LORA_PATHS = ("adapter", "merge")
"""How routed-expert LoRA adapters reach SGLang: served as adapters, or merged into the base."""


@dataclass(frozen=True)
class TERecipe:
    """A TE recipe candidate for one rollout format."""

    format: str
    """The ``--qrl-rollout-format`` it would serve."""
    recipe: str
    """The ``transformer_engine.common.recipe`` class name."""
    megatron: dict[str, str]
    """``TransformerConfig`` fields that make megatron-core wrap its TE layers in this recipe."""
    capabilities: tuple[int, ...]
    """CUDA compute-capability majors that run it (9: Hopper, 10: Blackwell)."""
    matches_spec: bool
    """True if TE's quantized values equal the spec's reference quantizer."""
    why: str
    """What differs (or what makes it equal)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment TE must see before it is imported."""
    within_rounding: bool = False
    """True if TE differs from the spec only by rounding (at most one quantization step per
    element): usable when asked for ``approximate`` (speed measurements), never by default."""


@dataclass(frozen=True)
class KernelFlags:
    """How SGLang's MoE method of a format calls ``fused_experts``."""

    use_fp8_w8a8: bool = False
    use_int8_w8a8: bool = False
    per_channel_quant: bool = False
    block_shape: tuple[int, int] | None = None


@dataclass(frozen=True)
class EngineFacts:
    """One format's engine facts; the first four have no default, so a format states each
    (``None`` where it has none). Measured on SGLang 0.5.17 / TE 2.20.2 on the H200 unless a
    field says otherwise."""

    sglang_syncs: Mapping[str, bool]
    """SGLang weight-sync path -> measured to work (True) or to fail (False); a path not
    listed was not run (tests/gpu/test_sglang_engine.py, tests/gpu/test_sglang_inplace.py;
    ``distributed`` between two GPUs over NCCL). Plain ``tensor`` (SGLang's own
    ``model.load_weights``) cannot reload a layer whose weights its quantization re-processed
    after loading: it is refused for a weight-quantizing format unless listed True."""
    te_recipe: TERecipe | None
    """The TE recipe that could serve the aligned forward, matching or not (None: no TE
    recipe computes this format)."""
    moe_kernel: KernelFlags | None
    """The flags SGLang's Triton fused-MoE kernel runs this format's experts with on Hopper
    (None: its MoE runs Marlin kernels, which have no Triton tile configuration)."""
    lora_experts: str
    """Routed-expert LoRA adapters on the H200: ``adapter`` (SGLang serves them) or ``merge``
    (SGLang's MoE runner for this format has no LoRA)."""
    direct_write: bool = False
    """SGLang's live tensors of this format are its packed tensors (up to a transpose, in
    fused / expert-stacked parameters) or their Marlin layout, which the writer produces
    (``w4a16``): the colocated direct writer writes straight into them
    (``--qrl-rollout-sglang-sync direct``). Read from SGLang 0.5.17's source (``w8a8_fp8.py``,
    ``w8a8_int8.py``, ``fp8.py`` with ``weight_block_size``, compressed-tensors WNA16)."""
    lora_marlin: bool = False
    """Served expert adapters run SGLang's Marlin LoRA MoE runner (``MarlinLoraRunnerCore``:
    compute capability >= 9.0, merged below; CUDA graphs off, :attr:`LoraServing.eager_reason`)."""
    lora_moe_runner: str | None = None
    """``moe_runner_backend`` an engine serving expert adapters needs where SGLang's default
    (``auto``) picks a runner without LoRA (see ``EXPERT_LORA_MOE_RUNNER``)."""
    lora_merge_from: tuple[int, int] | None = None
    """Compute capability from which expert adapters are merged instead (the format's MoE runs
    another runner there)."""

    def __post_init__(self) -> None:
        bad = sorted(set(self.sglang_syncs) - set(SYNC_MODES))
        if bad:
            raise ValueError(f"EngineFacts.sglang_syncs: unknown sync paths {bad}; "
                             f"the paths are {list(SYNC_MODES)}")
        if self.lora_experts not in EXPERT_LORA_PATHS:
            raise ValueError(f"EngineFacts.lora_experts must be one of {list(EXPERT_LORA_PATHS)}, "
                             f"got {self.lora_experts!r}")
