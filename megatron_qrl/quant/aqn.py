"""AQN: adaptive quantization noise on the rollout copy's RMSNorm gains (QeRL).

QeRL (seed 002) adds Gaussian noise to the RMSNorm gains of the ROLLOUT weights after each
weight sync, never to the trainer's weights::

    w_noisy = w + z,   z ~ N(0, sigma^2 I_d)   (one draw per norm per sync)

A gain ``w`` multiplies the input of the linears after it, so ``(w + z)`` acts as row-wise
multiplicative noise ``W diag(1 + z / w)`` on them: q/k/v share the draw of
``input_layernorm``, the MLP gate/up (every expert's and the router) share the draw of
``post_attention_layernorm``. That is the noise that mimics (and adds to) quantization
noise on the quantized linears and raises policy entropy for exploration, so those two
gains are the default targets. Not included by default: ``q_norm`` / ``k_norm`` act after
the projections (noise there perturbs attention logits, not a linear's weights) and the
final ``model.norm`` feeds ``lm_head``, which QeRL keeps unquantized. ``targets`` is a
parameter for other choices. The importance weight ``pi_prox / pi_behav`` (decoupled PPO /
TIS, docs/ALGORITHMS.md section 2) accounts for the noise when enabled.

Schedule (docs/ALGORITHMS.md section 3): ``K`` stages evenly spaced over the run; stage 0 has
``sigma = 0``, stage ``k >= 1`` has
``sigma_k = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))``,
a geometric decay from ``sigma_start`` (stage 1) to ``sigma_end`` (stage K-1).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_AQN_TARGETS",
    "AQNConfig",
    "aqn_sigma",
    "aqn_stage",
    "apply_aqn",
    "is_aqn_target",
]

DEFAULT_AQN_TARGETS: tuple[str, ...] = ("input_layernorm.weight", "post_attention_layernorm.weight")
"""Name suffixes (after a ``.``) of the RMSNorm gains that feed quantized linears."""


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"AQN: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_sigma(name: str, value: object, *, allow_zero: bool) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    low_ok = ok and (float(value) >= 0.0 if allow_zero else float(value) > 0.0)
    if not ok or not math.isfinite(float(value)) or not low_ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"AQN: {name} must be a finite number {bound}, got {value!r}")
    return float(value)


def aqn_stage(step: int, total_steps: int, num_stages: int) -> int:
    """The AQN stage of 0-based ``step`` in a run of ``total_steps`` steps.

    Stages are ``K = num_stages`` equal slices of the run: ``stage = floor(step * K /
    total_steps)`` in integer arithmetic, so stage k covers steps
    ``[ceil(k * T / K), ceil((k + 1) * T / K))``; step 0 is stage 0 and step ``T - 1`` is
    stage ``K - 1`` (when ``T < K`` some stages hold no step).
    """
    total_steps = _check_int("total_steps", total_steps, 1)
    num_stages = _check_int("num_stages", num_stages, 2)
    step = _check_int("step", step, 0)
    if step >= total_steps:
        raise ValueError(f"AQN: step {step} is past the run (0-based, total_steps={total_steps})")
    return step * num_stages // total_steps


def aqn_sigma(
    step: int,
    total_steps: int,
    sigma_start: float = 1e-2,
    sigma_end: float = 5e-4,
    num_stages: int = 10,
) -> float:
    """QeRL's AQN noise scale at 0-based ``step`` (docs/ALGORITHMS.md section 3).

    Stage 0 (the first ``1/K`` of the run) is noise-free; stage ``k >= 1`` uses
    ``sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))`` so stage 1 is
    ``sigma_start`` and stage ``K - 1`` is ``sigma_end``. With ``K = 2`` the single noisy
    stage uses ``sigma_start`` (the exponent 0/0 is read as 0). See :func:`aqn_stage`.
    """
    sigma_start = _check_sigma("sigma_start", sigma_start, allow_zero=False)
    sigma_end = _check_sigma("sigma_end", sigma_end, allow_zero=False)
    stage = aqn_stage(step, total_steps, num_stages)
    if stage == 0:
        return 0.0
    frac = 0.0 if num_stages == 2 else (stage - 1) / (num_stages - 2)
    return sigma_start * (sigma_end / sigma_start) ** frac


def is_aqn_target(name: str, targets: Iterable[str] = DEFAULT_AQN_TARGETS) -> bool:
    """True when ``name`` is one of ``targets`` or ends with ``"." + target``."""
    return any(name == t or name.endswith("." + t) for t in targets)


@torch.no_grad()
def _noisy(name: str, tensor: torch.Tensor, sigma: float, gen: torch.Generator) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise ValueError(f"AQN: norm gain {name!r} has dtype {tensor.dtype}, expected floating")
    noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32, device=gen.device)
    wide = tensor.to(torch.float32) + sigma * noise.to(tensor.device)
    return wide.to(tensor.dtype)


def apply_aqn(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    sigma: float,
    generator: torch.Generator,
    targets: Iterable[str] = DEFAULT_AQN_TARGETS,
) -> Iterator[tuple[str, torch.Tensor]]:
    """QeRL AQN on a stream of ``(hf_name, tensor)`` pairs bound for the rollout engine.

    Each tensor named by ``targets`` (see :func:`is_aqn_target`) is replaced by a NEW tensor
    ``w + z``, ``z ~ N(0, sigma^2)`` drawn in fp32 from ``generator`` (one draw of the gain's
    shape per norm, in stream order) and cast once to the gain's dtype. Every other pair is
    passed through as is, lazily; the input tensors (the trainer's weights) are never
    modified. ``sigma == 0`` passes everything through and draws nothing. The same stream
    order and generator state give the same noise (see ``AQNConfig.generator``).
    Arguments are checked now, not at the first ``next()``.
    """
    sigma = _check_sigma("sigma", sigma, allow_zero=True)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"AQN: generator must be a torch.Generator, got {type(generator)!r}")
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets:
        raise ValueError("AQN: targets is empty; pass the norm-gain names to perturb")
    return _stream(iter(named_tensors), sigma, generator, targets)


def _stream(
    pairs: Iterator[tuple[str, torch.Tensor]],
    sigma: float,
    gen: torch.Generator,
    targets: tuple[str, ...],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in pairs:
        if sigma > 0.0 and is_aqn_target(name, targets):
            yield name, _noisy(name, tensor, sigma, gen)
        else:
            yield name, tensor


@dataclass
class AQNConfig:
    """Adaptive quantization noise (QeRL) on the rollout copy of the RMSNorm gains."""

    enabled: bool = False
    """Add scheduled Gaussian noise to the rollout engine's RMSNorm gains after each sync."""

    sigma_start: float = 1e-2
    """Noise std of the first noisy stage (stage 1); QeRL's default 1e-2."""

    sigma_end: float = 5e-4
    """Noise std of the last stage (K-1), reached by geometric decay; QeRL's default 5e-4."""

    num_stages: int = 10
    """Number K of equal stages over the run; stage 0 is noise-free. At least 2."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"AQN: enabled must be a bool, got {self.enabled!r}")
        _check_sigma("sigma_start (--qrl-aqn-sigma-start)", self.sigma_start, allow_zero=False)
        _check_sigma("sigma_end (--qrl-aqn-sigma-end)", self.sigma_end, allow_zero=False)
        _check_int("num_stages (--qrl-aqn-num-stages)", self.num_stages, 2)

    def sigma(self, step: int, total_steps: int) -> float:
        """The noise std at 0-based ``step``; 0 when AQN is disabled."""
        if not self.enabled:
            return 0.0
        return aqn_sigma(step, total_steps, self.sigma_start, self.sigma_end, self.num_stages)

    @staticmethod
    def generator(seed: int, step: int, device: str | torch.device = "cpu") -> torch.Generator:
        """A generator seeded from ``(seed, step)``: the noise of a sync does not depend on
        how many syncs ran before it, so a resumed run draws the same noise."""
        _check_int("seed", seed, 0)
        _check_int("step", step, 0)
        gen = torch.Generator(device=device)
        gen.manual_seed((seed * 1_000_003 + step) % (2**63))
        return gen
