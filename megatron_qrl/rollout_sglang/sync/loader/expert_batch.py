"""Many experts per copy: batched ``FusedMoE.weight_loader`` effects (SGLang 0.5.17).

Shim for SGLang 0.5.17 (``sglang/srt/layers/moe/fused_moe_triton/layer.py``, read for this
module; line numbers below are that file's). ``FusedMoE.weight_loader`` costs one Python call
chain and one small copy per expert tensor (37-75k per Qwen3-30B-A3B sync). Here the expert
tensors of one bucket are grouped per parameter and destination region, and each group is
written with one ``torch.stack`` and one ``index_copy_`` into ``param.data[local_ids]`` — only
where every branch ``weight_loader`` would take was read and is reproduced exactly:

* expert ids (``weight_loader`` l.899-972, ``_weight_loader_physical`` l.974-1002): SGLang's own
  ``get_global_expert_location_metadata().logical_to_all_physical`` and
  ``_map_global_expert_id_to_local_expert_id`` (l.889) are CALLED, per tensor, so the slots
  (none, one, or several physical copies; ``_sglang_require_global_experts``) are SGLang's;
* ``_weight_loader_impl`` (l.1053-1295): the WNA16 ``loaded_weight.t()`` (l.1096-1108), the
  ``is_transposed`` shard dim (l.1133-1138) and the branch order on the weight name: input_scale
  -> ``_load_single_value`` (l.1152-1177, l.861), ModelOpt FP4 -> per-tensor / weight
  (l.1190-1216), scale by ``param.quant_method`` (l.1219-1265), weight_shape (l.1267-1272),
  weight (l.1274-1282);
* ``_load_w13`` (l.604-686) and ``_load_w2`` (l.688-772) without padded loading, pre-sharded
  weights, bias or triton-kernels: gate rows then up rows of the expert's slot (or up first with
  ``load_up_proj_weight_first``), the TP rank's narrow of the loaded tensor along the shard dim;
* ``_load_per_channel_weight_scale`` (l.583-602): w2 scale copied whole, w1/w3 as ``_load_w13``;
* ``_load_per_tensor_weight_scale`` (l.532-551): ``[expert][0|1]`` (gated) or ``[expert]``.

A parameter whose tensors do not ALL fit these (another method class or FusedMoE subclass, a
flag, padding, a shape that would broadcast or pad, a dtype change across devices, GGUF, g_idx,
zero points, bias, ROCm) is left to the per-tensor ``weight_loader``, exactly as before.
Several writes to one slot region keep the last in stream order, as sequential loads do.
Views of one expert-stacked wire tensor (``quant.expert_stacks.stack_experts``) that fill a
region with one distinct slot per expert are planned once for the whole stack
(:func:`_plan_stacked`); anything else is planned view by view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

METHODS = frozenset({"Fp8MoEMethod", "W8A8Int8MoEMethod", "W8A8FP8MoEMethod",
                     "ModelOptNvFp4FusedMoEMethod", "CompressedTensorsWNA16MoE",
                     "CompressedTensorsWNA16TritonMoE"})
"""Quant method (or compressed-tensors scheme) classes whose FusedMoE parameters were read."""
_WNA16 = ("CompressedTensorsWNA16MarlinMoE", "CompressedTensorsWNA16MoE",
          "CompressedTensorsWNA16TritonMoE")  # _weight_loader_impl's transposed list
_REPRODUCED = ("weight_loader", "_weight_loader_physical", "_weight_loader_impl",
               "_load_gguf_weight", "_maybe_load_fp8_shared_expert_as_fp4", "_load_w13",
               "_load_w2", "_load_model_weight_or_group_weight_scale",
               "_load_per_channel_weight_scale", "_load_per_tensor_weight_scale",
               "_load_single_value", "_map_global_expert_id_to_local_expert_id",
               "use_padded_loading")
_FLAGS_OFF = ("use_triton_kernels", "use_flashinfer_trtllm_moe", "use_padded_loading",
              "use_presharded_weights", "_has_fused_shared")
_SHARD_DIM = {"w1": 0, "w2": 1, "w3": 0}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class ExpertLoad:
    """One expert tensor and the ``weight_loader`` call the direct path would make for it."""

    index: int
    moe: torch.nn.Module
    param: torch.Tensor
    loader: object
    weight_name: str
    shard_id: str
    expert_id: int
    tensor: torch.Tensor
    stack: torch.Tensor | None = None
    """The expert-stacked wire tensor ``tensor`` is the view ``stack[expert_id]`` of, if any."""


@dataclass
class _Moe:
    base: type
    meta: object
    method: str
    quant_name: str | None
    writes: dict = field(default_factory=dict)


def fused_moe_base(moe: torch.nn.Module) -> type | None:
    """The ``FusedMoE`` class of ``moe`` if no method reproduced here is overridden."""
    base = next((c for c in type(moe).__mro__ if c.__name__ == "FusedMoE"), None)
    if base is None or any(n not in vars(base) or getattr(type(moe), n) is not vars(base)[n]
                           for n in _REPRODUCED):
        return None
    return base


def _moe_context(moe: torch.nn.Module) -> _Moe | None:
    base = fused_moe_base(moe)
    if base is None or any(getattr(moe, f, True) for f in _FLAGS_OFF):
        return None
    glb = vars(base)["weight_loader"].__globals__  # the names weight_loader resolves
    if glb.get("_is_hip", True) or "get_global_expert_location_metadata" not in glb:
        return None
    qm = getattr(moe, "quant_method", None)
    method = moe.scheme if hasattr(moe, "scheme") else qm
    if type(qm).__name__ == "KTEPWrapperMethod" or type(method).__name__ not in METHODS:
        return None
    qc = getattr(moe, "quant_config", None)
    return _Moe(base, glb["get_global_expert_location_metadata"](), type(method).__name__,
                qc.get_name() if qc is not None else None)


def _slots(ctx: _Moe, moe, param, expert: int) -> list[int] | None:
    """Local slots ``weight_loader`` writes for ``expert`` (l.923-972, l.982-986; metadata l.960)."""
    glob = getattr(param, "_sglang_require_global_experts", False)
    if ctx.meta is None:
        ids = [expert] if glob else [moe._map_global_expert_id_to_local_expert_id(expert)]
        ids = [i for i in ids if i != -1]
    else:
        ids = []
        for p in ctx.meta.logical_to_all_physical(moe.layer_id, expert, glob):
            local = p if glob else moe._map_global_expert_id_to_local_expert_id(p)
            if glob or 0 <= local < moe.num_local_experts:
                ids.append(local)
    return ids if all(0 <= i < param.shape[0] for i in ids) else None


def _kind(ctx: _Moe, param, name: str) -> str | None:
    """The ``_weight_loader_impl`` branch for ``name`` (l.1152-1282), or None."""
    if any(s in name for s in ("zero", "offset", "g_idx", "bias")):
        return None
    if "input_scale" in name:
        if ctx.quant_name is None or "compressed" in ctx.method.lower() \
                or "w4afp8" in ctx.quant_name:
            return None  # the w1 == w3 input-scale check reads the parameter
        return "single"
    if "ModelOpt" in ctx.method:  # only ModelOptNvFp4FusedMoEMethod is in METHODS
        return "tensor" if "weight_scale_2" in name else "weight" if "weight" in name else None
    if "scale" in name:
        return {"channel": "channel", "group": "weight", "block": "weight",
                "tensor": "tensor"}.get(getattr(param, "quant_method", None))
    if "weight_shape" in name:
        return "single"
    return "weight" if "weight" in name else None


def _w13_or_w2(ctx: _Moe, moe, shard: str, dim: int, slot: torch.Size, shape: torch.Size):
    """``_load_w13`` / ``_load_w2`` (not padded, not pre-sharded, no bias): the region and the
    ``(dim, start, length)`` narrow of the loaded tensor (its TP rank's part)."""
    if len(shape) != len(slot):
        return None
    if shard == "w2":
        if ctx.quant_name and "modelopt" in ctx.quant_name and len(slot) != 2:
            return None  # _load_w2 raises there
        size, start = slot[dim], 0
    else:
        gated = moe.moe_runner_config.is_gated
        size = slot[dim] // 2 if gated else slot[dim]
        up_first = getattr(moe.quant_method, "load_up_proj_weight_first", False)
        start = size if gated and (shard == "w1") == up_first else 0
    part = shape[dim] // moe.moe_tp_size
    return ("narrow", dim, start, size), (dim, part * moe.moe_tp_rank, part)


def _placement(ctx: _Moe, moe, param, load: ExpertLoad, kind: str):
    """(region, cut) of one tensor: where in its slot it lands, and how the loaded tensor is
    cut for it — ``(transpose, narrow or None)``, the same for every expert of one name and
    shape (:func:`_cut`)."""
    shape, shard = load.tensor.shape, load.shard_id
    transpose = ctx.method in _WNA16 and "zero" not in load.weight_name
    if transpose:
        if len(shape) > 2:
            return None
        shape = torch.Size(reversed(shape))  # .t()
    slot = param.shape[1:]
    dim = _SHARD_DIM[shard]
    if getattr(param, "is_transposed", False):
        dim = int(not dim)
    if kind == "weight" or (kind == "channel" and shard != "w2"):
        got = _w13_or_w2(ctx, moe, shard, dim, slot, shape)
        return None if got is None else (got[0], (transpose, got[1]))
    if kind == "channel" or kind == "single":
        return ("all",), (transpose, None)
    if shard != "w2" and moe.moe_runner_config.is_gated:  # kind == "tensor"
        return ("index", 0 if shard == "w1" else 1), (transpose, None)
    return ("all",), (transpose, None)


def _cut(t: torch.Tensor, cut: tuple) -> torch.Tensor:
    transpose, narrow = cut
    if transpose:
        t = t.t()
    return t if narrow is None else t.narrow(*narrow)


def _dest(data: torch.Tensor, region: tuple) -> torch.Tensor:
    if region[0] == "narrow":
        return data.narrow(region[1] + 1, region[2], region[3])
    if region[0] == "index":
        return data.select(1, region[1])
    return data


def _broadcasts_to(src: torch.Size, dst: torch.Size) -> bool:
    """``torch.broadcast_shapes(src, dst) == dst`` (setitem's rule), without its cost."""
    return len(src) <= len(dst) and all(a in (1, b) for a, b in zip(reversed(src), reversed(dst)))


def _overlap(a: tuple, b: tuple) -> bool:
    if a == b:
        return False  # one group: the last write per slot wins
    if a[0] == b[0] == "index":
        return False
    if a[0] == b[0] == "narrow" and a[1] == b[1]:
        return not (a[2] + a[3] <= b[2] or b[2] + b[3] <= a[2])
    return True


def _layout(ctx: _Moe, param, load: ExpertLoad):
    """``(region, cut, expand)`` of a load, or None (fall back): what :func:`_plan` needs of
    it besides its slots; it depends only on the name, shard, shape, dtype and device."""
    kind = _kind(ctx, param, load.weight_name) if load.shard_id in _SHARD_DIM else None
    placed = _placement(ctx, load.moe, param, load, kind) if kind else None
    if placed is None:
        return None
    region, cut = placed
    src = _cut(load.tensor, cut)
    shape = _dest(param.data[:1], region).shape[1:]
    expand = None
    if kind in ("single", "tensor"):  # setitem broadcasts
        if not _broadcasts_to(src.shape, shape):
            return None
        expand, src = shape, src.expand(shape)
    if src.shape != shape or src.dtype.is_complex or (
            src.dtype != param.dtype and src.device != param.device):
        return None
    return region, cut, expand


def _param_ok(ctx: _Moe, first: ExpertLoad) -> bool:
    """The parameter's loader is ``FusedMoE.weight_loader`` itself and its bits can be copied."""
    fn = getattr(first.loader, "__wrapped__", first.loader)
    param = first.param
    return (getattr(fn, "__self__", None) is first.moe
            and getattr(fn, "__func__", None) is vars(ctx.base)["weight_loader"]
            and not getattr(param, "is_gguf_weight", False)
            and not getattr(param, "is_gguf_weight_type", False)
            and not param.dtype.is_complex and param.element_size() in _BITS)


def _disjoint(regions: list) -> bool:
    return not any(_overlap(a, b) for i, a in enumerate(regions) for b in regions[i + 1:])


def _plan(ctx: _Moe, loads: list[ExpertLoad]) -> dict | None:
    """{region: (slots, sources stacked)} for one parameter's loads, or None (fall back)."""
    first = loads[0]
    moe, param = first.moe, first.param
    plan: dict[tuple, dict[int, torch.Tensor]] = {}
    kinds: dict[tuple, tuple] = {}  # region -> (dtype, device) of its sources: one stack each
    layouts: dict[tuple, tuple | None] = {}  # per name / shard / shape / dtype / device
    for ld in loads:
        t = ld.tensor
        key = (ld.weight_name, ld.shard_id, t.shape, t.dtype, t.device)
        if key not in layouts:
            layouts[key] = _layout(ctx, param, ld)
        lay = layouts[key]
        slots = _slots(ctx, moe, param, ld.expert_id) if lay is not None else None
        if slots is None:
            return None
        region, cut, expand = lay
        src = _cut(t, cut)
        if expand is not None:
            src = src.expand(expand)
        if kinds.setdefault(region, (src.dtype, src.device)) != (src.dtype, src.device):
            return None  # one torch.stack per region
        for s in slots:
            plan.setdefault(region, {})[s] = src  # the last write per slot wins
    if not _disjoint(list(plan)):
        return None
    return {r: (list(by_slot), torch.stack(list(by_slot.values()))) for r, by_slot in plan.items()}


def _plan_stacked(ctx: _Moe, loads: list[ExpertLoad]) -> dict | None:
    """:func:`_plan` without a Python step per expert, when every load is a view of an
    expert-stacked wire tensor (experts 0..E-1 in order), each expert has exactly one slot,
    distinct, and each region gets one stacked tensor: its cut is applied to the whole stack
    (``.t()`` of a 2-D view is the stack's last two dims, a narrow of view dim d is stack dim
    d + 1). None: :func:`_plan` decides, view by view."""
    runs: dict[int, list[ExpertLoad]] = {}
    for ld in loads:
        if ld.stack is None:
            return None
        runs.setdefault(id(ld.stack), []).append(ld)
    first = loads[0]
    plan: dict[tuple, tuple] = {}
    for run in runs.values():
        head, stack = run[0], run[0].stack
        if [ld.expert_id for ld in run] != list(range(stack.shape[0])):
            return None
        lay = _layout(ctx, first.param, head)
        if lay is None or lay[0] in plan:
            return None
        region, (transpose, narrow), expand = lay
        ids = []
        for ld in run:
            slots = _slots(ctx, first.moe, first.param, ld.expert_id)
            if slots is None or len(slots) != 1:
                return None
            ids += slots
        if len(set(ids)) != len(ids):
            return None
        src = stack.transpose(-2, -1) if transpose and stack.dim() == 3 else stack
        if narrow is not None:
            src = src.narrow(narrow[0] + 1, narrow[1], narrow[2])
        if expand is not None:  # setitem's broadcast of each view, for all views at once
            lead = (len(run),) + (1,) * (len(expand) - src.dim() + 1)
            src = src.reshape(lead + tuple(src.shape[1:])).expand((len(run),) + tuple(expand))
        plan[region] = (ids, src)
    return plan if _disjoint(list(plan)) else None


def _write(param: torch.Tensor, plan: dict) -> None:
    data = param.data
    bits = _BITS[data.element_size()]
    for region, (slots, src) in plan.items():
        src = src.to(device=data.device, dtype=data.dtype)
        ids = torch.tensor(slots, dtype=torch.long, device=data.device)
        _dest(data, region).view(bits).index_copy_(0, ids, src.view(bits))


def load_batched(loads: list[ExpertLoad]) -> list[ExpertLoad]:
    """Write every parameter's loads that can be batched exactly; return the others in
    stream order, for the per-tensor ``weight_loader``."""
    by_param: dict[int, list[ExpertLoad]] = {}
    for ld in loads:
        by_param.setdefault(id(ld.param), []).append(ld)
    contexts: dict[int, _Moe | None] = {}
    left: list[ExpertLoad] = []
    for group in by_param.values():
        moe = group[0].moe
        if id(moe) not in contexts:
            contexts[id(moe)] = _moe_context(moe)
        ctx = contexts[id(moe)]
        plan = None
        if ctx is not None and _param_ok(ctx, group[0]):
            plan = _plan_stacked(ctx, group) or _plan(ctx, group)
        if plan is None:
            left.extend(group)
            continue
        _write(group[0].param, plan)
        add = getattr(group[0].loader, "qrl_add_loads", None)
        if add is not None:  # the in-place loader counts weight_loader calls per parameter
            add(len(group))
    return sorted(left, key=lambda ld: ld.index)
