"""Which live parameters of an SGLang module are in the Marlin layout, and how.

Runs inside SGLang's scheduler process (with :mod:`.storage`). Read from SGLang 0.5.17's
``layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py`` and
``compressed_tensors_wNa16_moe.py`` (CUDA, Marlin runner), after
``process_weights_after_loading``:

* linear (``module.scheme`` a ``CompressedTensorsWNA16``): ``weight_packed`` is
  ``gptq_marlin_repack`` of the checkpoint words (``size_k`` = the partition's K),
  ``weight_scale`` is ``marlin_permute_scales`` of their transpose with that ``size_k``
  (runs of 64 where ``group_size < size_k``, else runs of 8); ``weight_shape`` stays, and
  ``weight_g_idx`` / ``weight_zero_point`` become empty tensors (no act order, symmetric);
* MoE (``CompressedTensorsWNA16MoE``, ``is_marlin_converted`` set): ``w13_`` / ``w2_weight_packed``
  ``gptq_marlin_moe_repack``-ed in their own storage; ``w13_weight_scale`` permuted with
  ``size_k = w13_weight_packed.shape[2]`` (the repacked width, as SGLang passes it),
  ``w2_weight_scale`` with ``size_k = groups * group_size``; the shapes, ``g_idx`` and sort
  indices are the engine's own (empty without act order).

Only 4 bits, symmetric, group 128 (the ``w4a16`` format's), no act order: anything else is
refused naming the setting. ``CompressedTensorsWNA16TritonMoE`` (ROCm) keeps another layout
and is refused by name.
"""

from __future__ import annotations

import torch

from megatron_qrl.sync.protocol.engine_layout import EngineLayoutError

GROUP = 128
"""The w4a16 group size the writer serves (``quant.formats.w4a16.GROUP``; this module runs
inside SGLang and imports nothing of the trainer's side, so the number stands here and a test
holds the two equal)."""

__all__ = ["SCHEMES", "marlin_kind", "marlin_leaves"]

SCHEMES = {"CompressedTensorsWNA16": "linear", "CompressedTensorsWNA16MoE": "moe"}
"""SGLang WNA16 schemes on the Marlin path -> linear / moe."""
_FIX = "use --qrl-rollout-sglang-sync inplace"


def _scheme(module: torch.nn.Module):
    qm = getattr(module, "quant_method", None)
    return getattr(module, "scheme", None) or getattr(qm, "scheme", None) or qm


def _settings(scheme, kind: str) -> dict[str, object]:
    """The scheme's bits, symmetry, group size, act order and whether post-load has run."""
    if kind == "linear":
        return {"bits": 32 // scheme.pack_factor, "symmetric": scheme.symmetric,
                "group": scheme.group_size, "act order": scheme.has_g_idx,
                "processed": hasattr(scheme, "workspace")}
    return {"bits": scheme.num_bits, "symmetric": True, "group": scheme.group_size,
            "act order": bool(scheme.actorder), "processed": None}


def marlin_kind(module: torch.nn.Module, name: str) -> str | None:
    """``linear`` / ``moe`` where ``module`` runs a WNA16 Marlin scheme this writer feeds,
    None where it runs no WNA16 scheme; raises naming the setting it cannot feed."""
    scheme = _scheme(module)
    cls = type(scheme).__name__
    kind = SCHEMES.get(cls)
    if kind is None:
        if "WNA16" in cls:
            raise EngineLayoutError(f"direct weight sync: {name} runs {cls}, whose live layout "
                                    f"is not Marlin's; {_FIX}")
        return None
    got = _settings(scheme, kind)
    if kind == "moe":
        got["processed"] = bool(getattr(module, "is_marlin_converted", False))
    want = {"bits": 4, "symmetric": True, "group": GROUP, "act order": False, "processed": True}
    bad = {k: v for k, v in got.items() if v != want[k]}
    if bad:
        raise EngineLayoutError(
            f"direct weight sync: {name} runs {cls} with {bad}; the Marlin writer covers "
            f"{want} (act order / g_idx, other group sizes, zero points and unprocessed "
            f"layers are not covered); {_FIX}")
    return kind


def _grouped(size_k: int) -> str:
    """``marlin_permute_scales``'s choice: runs of 64 where ``group_size < size_k``."""
    return "scales" if GROUP < size_k else "scales_single"


def marlin_leaves(module: torch.nn.Module, kind: str | None) -> dict[str, str | None] | None:
    """Leaf -> Marlin kind (``codes`` / ``scales`` / ``scales_single``) of every parameter of a
    Marlin module; None (value) for a leaf the engine keeps (not synced); None (result) for a
    module that is not a Marlin one."""
    if kind is None or SCHEMES.get(type(_scheme(module)).__name__) != kind:
        return None
    if kind == "linear":
        groups = module.weight_scale.shape[0]
        return {"weight_packed": "codes", "weight_scale": _grouped(groups * GROUP),
                "weight_shape": None, "weight_g_idx": None, "weight_zero_point": None}
    leaves: dict[str, str | None] = {}
    for w in ("w13_", "w2_"):
        size_k = (module.w13_weight_packed.shape[2] if w == "w13_"
                  else module.w2_weight_scale.shape[1] * GROUP)
        leaves |= {f"{w}weight_packed": "codes", f"{w}weight_scale": _grouped(size_k),
                   f"{w}weight_shape": None, f"{w}weight_g_idx": None,
                   f"{w}g_idx_sort_indices": None}
    return leaves
