"""SHIM: megatron_qrl's QuantSpec packs (+ AQN) in slime's weight sync. slime 0.3.1 only.

Why a shim. slime 0.3.1 (commit 624b824a8) quantizes what it sends to SGLang inside
``slime.backends.megatron_utils.megatron_to_hf.convert_to_hf``, which calls that module's
``quantize_params(args, megatron_name, converted_named_params, quantization_config,
transform_ue8m0)``: an if-chain on ``quantization_config["quant_method"]`` (``fp8`` and
``compressed-tensors`` INT4; any other method is passed through in BF16, silently). No flag,
registry or hook selects another quantizer, and every sync path (tensor, distributed, disk)
goes through ``convert_to_hf``. The narrowest extension point is therefore that one module
attribute: :func:`install_quantizer` (called by the init hook) replaces
``megatron_to_hf.quantize_params`` — the name ``convert_to_hf`` looks up at call time — with a
:class:`QrlSlimeQuantizer`; nothing else of slime is touched. It checks the replaced function's
signature first and refuses a slime whose ``quantize_params`` differs from 0.3.1's.

With it installed, every tensor of every sync is ``QuantSpec.pack_state_dict`` of the HF tensors
slime's converter made from one Megatron parameter (q/k/v and gate/up arrive together, so fused
groups share their scale exactly as in ``tools/export_quantized.py``), after AQN noise on the
norm gains (rollout copy only; the trainer's weights are never modified). The checkpoint the
engine started from (slime's ``--hf-checkpoint``, exported by ``tools/export_quantized.py``)
must carry the format's own ``quantization_config``; anything else is one clear error.
Caveat: slime's ``--save-hf`` goes through the same function, so it saves the packed rollout copy
(with that sync's AQN noise); Megatron checkpoints (``--save``) keep the clean weights.
"""

from __future__ import annotations

import importlib
import inspect
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_qrl.quant import QuantSpec, get_spec
from megatron_qrl.quant.aqn import AQNConfig, apply_aqn

SLIME_MODULE = "slime.backends.megatron_utils.megatron_to_hf"
SLIME_SIGNATURE = ("args", "megatron_name", "converted_named_params", "quantization_config",
                   "transform_ue8m0")
"""Parameters of slime 0.3.1's ``quantize_params``, the function this shim stands in for."""


def check_checkpoint_config(spec: QuantSpec, quantization_config: Mapping[str, Any] | None) -> None:
    """The engine's checkpoint must be quantized exactly as ``spec`` packs (else one error)."""
    expected = spec.hf_quantization_config()
    export = (f"point slime's --hf-checkpoint at `python tools/export_quantized.py --format "
              f"{spec.name}` output (SGLang loads the format from its config.json)")
    if expected is None:
        if quantization_config is not None:
            raise ValueError(f"--qrl-rollout-format {spec.name} but --hf-checkpoint is quantized "
                             f"(quant_method {quantization_config.get('quant_method')!r}); "
                             "use the BF16 checkpoint or set the matching --qrl-rollout-format")
        return
    if quantization_config is None:
        raise ValueError(f"--qrl-rollout-format {spec.name}: --hf-checkpoint has no "
                         f"quantization_config; {export}")
    differ = sorted(k for k, v in expected.items() if quantization_config.get(k) != v)
    if differ:
        raise ValueError(f"--qrl-rollout-format {spec.name}: --hf-checkpoint's quantization_config "
                         f"differs in {differ} (quant_method "
                         f"{quantization_config.get('quant_method')!r}); {export}")


@dataclass
class QrlSlimeQuantizer:
    """Stands in for slime's ``quantize_params``: QuantSpec packs of one parameter's tensors."""

    spec: QuantSpec
    aqn: AQNConfig
    seed: int
    total_steps: int
    replaced: Callable[..., Any]
    """slime's own ``quantize_params`` (put back by :func:`uninstall_quantizer`)."""
    step: int = 0
    """AQN step of the next sync (the before-train-step hook sets rollout_id + 1)."""

    def __call__(self, args: Any, megatron_name: str,
                 converted_named_params: list[tuple[str, Any]],
                 quantization_config: Mapping[str, Any] | None,
                 transform_ue8m0: bool = True) -> list[tuple[str, Any]]:
        check_checkpoint_config(self.spec, quantization_config)
        stream = converted_named_params
        sigma = self.aqn.sigma(min(self.step, max(self.total_steps - 1, 0)), self.total_steps)
        if sigma > 0.0:
            stream = apply_aqn(stream, sigma, self.generator(megatron_name))
        return list(self.spec.pack_state_dict(stream))

    def generator(self, megatron_name: str):
        """AQN noise of one parameter at ``step``: seeded by (seed, name, step), so it does not
        depend on which rank converts the parameter or in which order."""
        name_seed = (self.seed + zlib.crc32(megatron_name.encode())) % (2**31)
        return AQNConfig.generator(name_seed, self.step)


def _module():
    return importlib.import_module(SLIME_MODULE)


def installed_quantizer() -> QrlSlimeQuantizer | None:
    """The installed :class:`QrlSlimeQuantizer` of this process, if any."""
    current = getattr(_module(), "quantize_params", None)
    return current if isinstance(current, QrlSlimeQuantizer) else None


def install_quantizer(fmt: str, aqn: AQNConfig | None = None, seed: int = 0,
                      total_steps: int = 1) -> QrlSlimeQuantizer:
    """Route slime's weight-sync quantization through QuantSpec ``fmt`` (see the module doc).

    An unknown ``fmt`` raises naming the registered formats; installing again replaces the
    previous qrl quantizer (slime's own function stays the one to restore).
    """
    spec = get_spec(fmt)
    module = _module()
    current = module.quantize_params
    if isinstance(current, QrlSlimeQuantizer):
        current = current.replaced
    else:
        params = tuple(inspect.signature(current).parameters)
        if params != SLIME_SIGNATURE:
            raise RuntimeError(
                f"{SLIME_MODULE}.quantize_params{params} is not slime 0.3.1's {SLIME_SIGNATURE}; "
                "megatron_qrl's weight-sync shim supports slime 0.3.1 only")
    quantizer = QrlSlimeQuantizer(spec, aqn or AQNConfig(), seed, max(int(total_steps), 1), current)
    module.quantize_params = quantizer
    return quantizer


def uninstall_quantizer() -> None:
    """Put slime's own ``quantize_params`` back (no-op when none is installed)."""
    current = installed_quantizer()
    if current is not None:
        _module().quantize_params = current.replaced
