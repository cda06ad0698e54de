"""The engine's parameter storage as a service: describe it, hand it out, read it back.

Runs inside SGLang's scheduler process, reached like the in-place loader: an
``update_weights_from_tensor`` call whose ``load_format`` is
:data:`~megatron_qrl.sync.protocol.engine_layout.STORAGE` (registered with
``custom_weight_loader``) and whose one tensor is the control message
(:mod:`megatron_qrl.sync.protocol.engine_layout`). Three requests:

* ``export``: :func:`describe` the live parameters and write ``{"layout", "tensors"}`` to
  ``out`` through SGLang's own ``MultiprocessingSerializer`` (each parameter as its CUDA IPC
  handle), so the trainer writes into them;
* ``fingerprint``: the storage addresses now (:func:`storage_fingerprint`), to see whether
  SGLang moved a parameter since the handles were taken;
* ``digest``: the fingerprints of the regions the trainer wrote (``names``: packed name ->
  shape), read back from the live tensors, and the storage fingerprint;
* ``write``: the trainer's tensors that came with the request written here instead
  (:mod:`.storage_write`: where the memory saver's parameters cannot be handed out).

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
import json
import os
from collections.abc import Sequence

import torch

from megatron_qrl.sync.protocol.checksums import Checksums
from megatron_qrl.sync.protocol.engine_layout import (
    ERROR,
    EngineLayout,
    EngineLayoutError,
    ParamLayout,
    locate,
    view,
)
from megatron_qrl.sync.protocol.inplace import CONTROL, decode_control, expert_names
from megatron_qrl.sync.protocol.marlin import checkpoint_shape, from_live
from megatron_qrl.sync.protocol.wire import dtype_name
from megatron_qrl.utils.hf_names import FUSION_MEMBERS, STACKED

from .marlin_params import marlin_kind, marlin_leaves

__all__ = ["LINEAR_T", "METHODS", "describe", "handle", "serve", "storage_fingerprint"]

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


def handle(model: torch.nn.Module, msg: dict,
           items: Sequence[tuple[str, torch.Tensor]] = ()) -> dict:
    """One storage request (module docstring), answered in this process; ``export`` gives the
    tensors themselves (``serve`` turns them into handles); ``items``: the tensors that came
    with a ``write`` request."""
    what = msg["what"]
    if what == "write":
        from .storage_write import write

        return write(model, msg, items)
    layout, tensors = describe(model)
    if what == "export":
        return {"layout": layout, "tensors": tensors}
    if what == "fingerprint":
        return {"fingerprint": layout.fingerprint}
    if what == "digest":
        return {"fingerprint": layout.fingerprint,
                "digest": read_digest(layout, tensors, msg["names"])}
    raise ValueError(f"engine storage request {what!r}: expected export, fingerprint, digest "
                     "or write")


def _share(obj: dict) -> bytes:
    """``obj`` serialized as SGLang shares tensors between its processes."""
    from sglang.srt.utils import MultiprocessingSerializer

    try:
        return MultiprocessingSerializer.serialize(obj)
    except RuntimeError as exc:  # e.g. memory the memory saver maps (no IPC handle)
        raise EngineLayoutError(
            f"direct weight sync: the engine's parameters cannot be shared by CUDA IPC ({exc}); "
            "start the engine without its memory saver (--no-qrl-rollout-sglang-release-memory) "
            "or use --qrl-rollout-sglang-sync inplace") from exc


def serve(model: torch.nn.Module, named_tensors) -> None:
    """SGLang custom weight loader: answer the control message's request into its ``out``
    file (``export``: SGLang's ``MultiprocessingSerializer``, whose CUDA tensors travel as IPC
    handles with the device named by UUID; JSON otherwise; temp + rename). A request that
    fails is answered too, as ``{"error": class name, "message": ...}`` in ``out.<pid>.error``:
    an exception raised here would end SGLang's scheduler, and the engine with it."""
    msgs = [decode_control(t) for n, t in named_tensors if n == CONTROL]
    if len(msgs) != 1:
        raise EngineLayoutError(f"engine storage request carries {len(msgs)} control tensors, "
                                "expected 1")
    msg = msgs[0]
    path = f"{msg['out']}.{os.getpid()}"
    try:
        data = _answer(model, msg, [(n, t) for n, t in named_tensors if n != CONTROL])
    except Exception as exc:  # answered to the trainer, which raises it (storage_client)
        data = json.dumps({"error": type(exc).__name__, "message": str(exc)}).encode()
        path += ERROR
    with open(f"{path}.tmp", "wb") as f:
        f.write(data)
    os.replace(f"{path}.tmp", path)


def _answer(model: torch.nn.Module, msg: dict,
            items: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """The bytes of :func:`handle`'s answer to ``msg`` (:func:`serve`)."""
    out = handle(model, msg, items)
    if msg["what"] == "export":
        return _share({"layout": out["layout"].to_json(), "tensors": out["tensors"]})
    return json.dumps(out).encode()
