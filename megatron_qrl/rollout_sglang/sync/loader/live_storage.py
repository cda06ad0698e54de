"""The engine's live parameters described in its own layout (the direct sync's regions),
their addresses fingerprinted, the regions written read back as fingerprints.

Runs inside SGLang's scheduler process, for the storage service (:mod:`.storage`) and the
engine-side write (:mod:`.storage_write`).

Which layouts are plain copies of the checkpoint's was read from SGLang 0.5.17's
``layers/quantization/w8a8_fp8.py`` and ``w8a8_int8.py`` (linear on CUDA: ``weight.t()`` of
the checkpoint's ``[out, in]`` codes, a view of the same storage, and the fp32 ``[out, 1]``
``weight_scale`` unchanged; MoE: ``w13_*`` / ``w2_*`` codes and their ``[E, rows, 1]`` scales
unchanged, run by the Triton fused-MoE kernel) and ``fp8.py`` with ``weight_block_size``
(linear and MoE unchanged on Hopper's Triton / CUTLASS path; refused where a UE8M0
requantization, Marlin or MXFP8 path rewrites them). ``w8a8_int8``'s CPU paths (AMX / Arm64
VNNI repacks) never hold a CUDA engine's weights. Compressed-tensors WNA16 (``w4a16``, read
from ``compressed_tensors_wNa16.py`` / ``compressed_tensors_wNa16_moe.py``) keeps
``weight_packed`` Marlin-repacked and ``weight_scale`` transposed and permuted
(:mod:`.marlin_params`); its parameters are described in their checkpoint shape with the
live tensor handed out. Any other quantized method is refused with the fix.
"""

from __future__ import annotations

import hashlib

import torch

from megatron_qrl.sync.protocol.checksums import Checksums
from megatron_qrl.sync.protocol.engine_layout import (
    EngineLayout,
    EngineLayoutError,
    ParamLayout,
    locate,
    view,
)
from megatron_qrl.sync.protocol.inplace import expert_names
from megatron_qrl.sync.protocol.marlin import checkpoint_shape, from_live
from megatron_qrl.sync.protocol.wire import dtype_name
from megatron_qrl.utils.hf_names import FUSION_MEMBERS, STACKED

from .marlin_params import marlin_kind, marlin_leaves

__all__ = ["LINEAR_T", "METHODS", "describe", "read_digest", "storage_fingerprint"]

METHODS = {"W8A8Fp8LinearMethod": "linear", "W8A8Int8LinearMethod": "linear",
           "Fp8LinearMethod": "linear",
           "W8A8FP8MoEMethod": "moe", "W8A8Int8MoEMethod": "moe", "Fp8MoEMethod": "moe"}
"""Quantized SGLang methods whose live tensors are the checkpoint's (up to a transpose)."""
LINEAR_T = frozenset({"W8A8Fp8LinearMethod", "W8A8Int8LinearMethod"})
"""Methods that keep ``weight.t()`` of the checkpoint weight."""
_REWRITES = ("use_marlin", "use_mxfp8", "convert_mxfp8_to_block")
"""Method flags of paths that rewrite the loaded tensors."""


def _method_kind(module: torch.nn.Module, name: str) -> str | None:
    """``linear`` / ``moe`` / None (unquantized) / ``kv`` (a KV-cache scale method: its
    ``k_scale`` / ``v_scale`` come from the checkpoint's KV scales, which no weight sync
    sends); raises for a method this writer cannot feed."""
    qm = getattr(module, "quant_method", None)
    if qm is None:
        return None
    cls = type(qm).__name__
    if cls.endswith("KVCacheMethod"):
        return "kv"
    marlin = marlin_kind(module, name)
    if marlin is not None:
        return marlin
    if cls.startswith("Unquantized"):
        return "moe" if hasattr(module, "num_local_experts") else "linear"
    kind = METHODS.get(cls)
    bad = [f for f in _REWRITES if getattr(qm, f, False)]
    if cls in ("Fp8LinearMethod", "Fp8MoEMethod") and not getattr(qm, "block_quant", False):
        bad.append("per-tensor scales (requantized after loading)")
    if kind is None or bad:
        why = f"flags {bad}" if kind else "its post-load processing is not a copy"
        raise EngineLayoutError(
            f"direct weight sync: {name} runs {cls} ({why}); the direct writer feeds "
            f"{sorted(METHODS)} on the Triton / CUTLASS path; use "
            "--qrl-rollout-sglang-sync inplace")
    return kind


def _linear_shards(name: str, module, leaf: str, rows: int) -> dict[str, tuple[int, int]]:
    members = FUSION_MEMBERS.get(name.rpartition(".")[2])
    sizes = list(getattr(module, "output_partition_sizes", None) or [])
    if members is None or len(sizes) != len(members):
        return {}
    total = sum(sizes)
    if rows == total:
        unit = 1
    else:  # a block-scale tensor: one row per block of output rows
        cfg = getattr(getattr(module, "quant_method", None), "quant_config", None)
        unit = int((getattr(cfg, "weight_block_size", None) or [0])[0])
        if not unit or rows != -(-total // unit) or any(s % unit for s in sizes[:-1]):
            return {}
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return {m: (s // unit, -(-(s + n) // unit)) for m, s, n in zip(members, starts, sizes)}


def _moe_shards(leaf: str, rows: int) -> dict[str, tuple[int, int]]:
    if not leaf.startswith("w13_") or rows % 2:
        return {}
    return {"gate_proj": (0, rows // 2), "up_proj": (rows // 2, rows)}


def describe(model: torch.nn.Module) -> tuple[EngineLayout, dict[str, torch.Tensor]]:
    """The layout of every live parameter of ``model`` and the tensors themselves
    (checkpoint views: ``live.t()`` where the engine keeps the transpose)."""
    params: dict[str, ParamLayout] = {}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        kind = _method_kind(module, mod_name)
        if kind == "kv":  # not synced: the engine keeps them
            continue
        leaves = marlin_leaves(module, kind)  # {leaf: Marlin kind or None (not synced)}
        for leaf, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mod_name}.{leaf}" if mod_name else leaf
            if leaves is not None and leaf not in leaves:
                raise EngineLayoutError(f"direct weight sync: {full} is not a parameter of "
                                        "SGLang 0.5.17's Marlin WNA16 layout; use "
                                        "--qrl-rollout-sglang-sync inplace")
            mk = leaves.get(leaf) if leaves is not None else ""
            if mk is None:  # weight_shape, g_idx, sort indices: the engine keeps its own
                continue
            if getattr(p, "format_ue8m0", False):
                raise EngineLayoutError(f"direct weight sync: {full} holds UE8M0 scales "
                                        "(DeepGEMM requantized them); use "
                                        "--qrl-rollout-sglang-sync inplace")
            t = p.detach()
            transposed = (kind == "linear" and leaf == "weight" and t.dim() == 2
                          and type(module.quant_method).__name__ in LINEAR_T)
            ck = t.t() if transposed else t
            shape = checkpoint_shape(mk, tuple(ck.shape)) if mk else tuple(ck.shape)
            shards = ((_moe_shards(leaf, shape[1]) if kind == "moe" and len(shape) > 1
                       else _linear_shards(mod_name, module, leaf, shape[0]))
                      if kind and shape else {})
            params[full] = ParamLayout(shape, dtype_name(ck.dtype), transposed,
                                       kind == "moe", shards, mk)
            tensors[full] = ck
    return EngineLayout(params, storage_fingerprint(tensors)), tensors


def storage_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of every tensor's name, address, shape and strides: equal while SGLang keeps
    the storage where it was."""
    h = hashlib.sha1()
    for name, t in tensors.items():
        h.update(f"{name}:{t.data_ptr()}:{tuple(t.shape)}:{t.stride()};".encode())
    return h.hexdigest()[:16]


def read_digest(layout: EngineLayout, tensors: dict[str, torch.Tensor],
                names: dict[str, list[int]]) -> dict[str, str]:
    """Fingerprints of the regions ``names`` (packed name -> shape) as held now, under the
    names the writer took them (an expert stack's experts under their own names)."""
    sums = Checksums()
    for name, shape in names.items():
        target = locate(layout, name)
        pl = layout.params[target.param]
        v = view(tensors[target.param], pl, target, tuple(shape))
        if pl.marlin:  # back to the checkpoint layout the writer fingerprinted
            v = from_live(pl.marlin, v)
        # views as held (kept: no batch bound, one launch where the Triton kernel reads them
        # in place); strided rows are read in place (an expert's half of its w13 is one
        # contiguous run), only what is not contiguous is copied
        if target.expert == STACKED:
            sums.add_rows(expert_names(name, v.shape[0]), v, kept=not pl.marlin)
        else:
            sums.add(name, v, kept=not pl.marlin)
    return sums.result()


