"""``--qrl-lora-*``: LoRA / QLoRA reinforcement learning (QeRL seed 002, rlquant seed 003).

LoRA (Hu et al. 2021, eq. 3): ``h = W0 x + (alpha / r) * B A x`` with ``A`` [r, in],
``B`` [out, r], ``B = 0`` at the start; ``W0`` frozen. QLoRA (Dettmers et al. 2023): ``W0``
held in NF4 with double quantization, adapters in 16 bit.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LORA_PROJECTIONS", "LORA_BASE_FORMATS_EXTRA", "LoraConfig"]

LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""HF projection names an adapter can target (PEFT ``target_modules``)."""

LORA_BASE_FORMATS_EXTRA = ("nf4",)
"""Base storage formats that are not rollout ``QuantSpec`` formats (trainer storage only)."""


def base_format_choices() -> tuple[str, ...]:
    from megatron_qrl.quant import list_specs

    return tuple(list_specs()) + LORA_BASE_FORMATS_EXTRA


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the trainer's linears; the base frozen (optionally quantized)."""

    rank: int = 0
    """Adapter rank r; 0 turns LoRA off (full-parameter RL)."""
    alpha: float | None = None
    """LoRA alpha; the update is scaled by alpha / rank (None: alpha = rank, QeRL)."""
    dropout: float = 0.0
    """Dropout on the adapter input (PEFT lora_dropout); 0 keeps the trainer forward equal to
    the engine's."""
    targets: tuple[str, ...] = LORA_PROJECTIONS
    """HF projections that get adapters (q_proj k_proj v_proj o_proj gate_proj up_proj
    down_proj); q/k/v and gate/up get one adapter each although Megatron fuses them."""
    experts: bool = False
    """Also put gate_proj / up_proj / down_proj adapters on every routed expert (SGLang serves
    expert LoRA only with both gate_up and down targets)."""
    base_format: str = "bf16"
    """How the frozen base is held in the trainer: bf16 (the parameter dtype), nf4 (QLoRA,
    double quantization; trainer storage only) or a --qrl-rollout-format name (packed codes +
    scales, dequantized per forward)."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"--qrl-lora-rank must be >= 0, got {self.rank}")
        if self.alpha is not None and self.alpha <= 0:
            raise ValueError(f"--qrl-lora-alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--qrl-lora-dropout must be in [0, 1), got {self.dropout}")
        bad = [t for t in self.targets if t not in LORA_PROJECTIONS]
        if bad or not self.targets:
            raise ValueError(f"--qrl-lora-targets {' '.join(self.targets) or '(empty)'}: "
                             f"{'unknown ' + ', '.join(bad) if bad else 'none given'}; choose "
                             f"from {' '.join(LORA_PROJECTIONS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"--qrl-lora-targets lists a projection twice: {self.targets}")
        choices = base_format_choices()
        if self.base_format not in choices:
            raise ValueError(f"--qrl-lora-base-format {self.base_format!r} is unknown; choose "
                             f"from {', '.join(choices)}")
        if self.experts and not {"gate_proj", "up_proj", "down_proj"} <= set(self.targets):
            raise ValueError("--qrl-lora-experts needs gate_proj, up_proj and down_proj in "
                             "--qrl-lora-targets (SGLang serves expert LoRA only with both the "
                             "gate_up and the down adapters)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """alpha / r (LoRA eq. 3)."""
        return (self.alpha if self.alpha is not None else float(self.rank)) / self.rank

    def peft_config(self) -> dict:
        """The PEFT ``adapter_config.json`` dict (what SGLang's ``LoRAConfig`` reads)."""
        return {"peft_type": "LORA", "r": self.rank,
                "lora_alpha": self.alpha if self.alpha is not None else float(self.rank),
                "lora_dropout": self.dropout, "target_modules": list(self.targets),
                "bias": "none", "task_type": "CAUSAL_LM"}
