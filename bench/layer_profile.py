"""Where a train micro batch's GPU time goes, by model part (bench/train_mfu.py ``--breakdown``).

One ``torch.profiler`` trace of a callable (a ``PolicyTrainer.train_step``): every GPU kernel is
charged to the nearest enclosing *part* on the CPU side —

* in the forward, the module whose forward launched it: ``qrl::`` ranges that forward hooks
  open around the attention, the MoE router, the experts, the whole MoE layer (what is left of
  it after router and experts: permute / dispatch / unpermute / combine / aux loss), the dense
  MLP, the norms, the embedding and the output layer (:func:`add_ranges`);
* in the backward, the autograd node that launched it (``evaluate_function: <Node>``), sorted
  into the same parts by the node's name (:data:`BACKWARD_PARTS`);
* ``optimizer`` (``Optimizer.step`` / ``optimizer``), and ``recompute:<part>`` for a forward
  range that runs inside a checkpointed layer's backward (activation recompute).

``host_top_ms``: the CPU ops with the most own (self) CPU time — where the host spends a
micro batch whose wall time is well above the GPU's busy time.
Kernels under none of these are ``other`` (the loss, the log-prob pass, gradient clipping...);
kernels whose launching op the profiler did not link are ``other (no launching op)``, and the
table says ATTRIBUTION FAILED for a row with more than half its time in these two
(:func:`attribution_failed`).
The aligned forward's quantizer kernels are split out of the part that launched them by their
name (:data:`KERNEL_PARTS`): ``<part>/quantize activations``, ``<part>/dequantize`` (the
straight-through backward's operands), ``<part>/Q(W)`` (the weight refresh, once per optimizer
step: the first micro batch after a step carries it).
The table is per micro-batch-call milliseconds of GPU kernel time (streams summed): each
device kernel record is charged once (:func:`charge`), so the parts add up to
``gpu_kernels_ms``, the GPU's busy time, not to the wall time. Without CUDA each op's own CPU
time is charged instead (checks the attribution on a CPU; not a speed measurement).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch

FORWARD_PARTS: tuple[tuple[str, str], ...] = (
    # (regex on the module's qualified name, part); the first match wins
    (r"\.mlp\.router$", "router"),
    (r"\.mlp\.experts$", "experts"),
    (r"\.self_attention$", "attention"),
    (r"\.mlp$", "mlp_or_moe"),
    (r"layernorm$|\.final_layernorm$|_layernorm$", "norm"),
    (r"\.output_layer$", "lm_head"),
    (r"embedding$", "embedding"),
)
"""Modules that get a ``qrl::<part>`` range; a MoE layer's own range (``mlp_or_moe``) keeps
only what its router and experts do not: dispatch, permutation, combine, aux loss."""

BACKWARD_PARTS: tuple[tuple[str, str], ...] = (
    (r"GroupedLinear|GroupedGemm|GroupedMLP|grouped|GroupedReal|StackSTE", "experts"),
    (r"[Pp]ermute|[Uu]npermute|Sort|IndexSelect|IndexAdd|Scatter|Gather|Index|AllToAll"
     r"|_AllToAll|MaskedScatter|Combine|Dispatch", "mlp_or_moe"),
    (r"Topk|TopK|Softmax|Router|Sigmoid|AuxLoss|fused_topk|ScoreFunction", "router"),
    (r"FusedAttn|FlashAttn|DotProductAttention|ScaledDotProduct|Attention|Rotary|RoPE|Rope",
     "attention"),
    (r"RMSNorm|LayerNorm|Norm", "norm"),
    (r"Embedding", "embedding"),
    (r"_Linear|Linear|Mm|Addmm|Bmm|Matmul", "linear"),
)
"""``evaluate_function: <Node>`` -> part, first match wins. Dense linears (qkv, proj, dense
MLP, output layer) share ``linear`` in the backward: their forward parts say which is which."""


KERNEL_PARTS: tuple[tuple[str, str], ...] = (
    (r"_act_token_kernel|_act_group_kernel|per_token_group_quant|per_token_quant",
     "quantize activations"),
    (r"_dequant_rows_kernel", "dequantize"),
    (r"_channel_(into_|fake_)?kernel|_(fp8_block|w4a16|nvfp4)(_fake)?_kernel", "Q(W)"),
)
"""GPU kernel name -> aligned-forward sub-part (our Triton quantizers, SGLang's activation
quantizers), charged as ``<part>/<sub-part>``."""

_FORWARD = frozenset(p for _, p in FORWARD_PARTS)
"""The forward part names (a recompute charges these, run again inside a backward)."""


def forward_part(name: str) -> str | None:
    """The part of the module called ``name`` (:data:`FORWARD_PARTS`), or None."""
    for pattern, part in FORWARD_PARTS:
        if re.search(pattern, name):
            return part
    return None


def backward_part(node: str) -> str:
    """The part of the autograd node ``node`` (:data:`BACKWARD_PARTS`), ``other`` if none."""
    for pattern, part in BACKWARD_PARTS:
        if re.search(pattern, node):
            return part
    return "other"


def add_ranges(model: torch.nn.Module) -> list[Any]:
    """Forward pre/post hooks opening a ``qrl::<part>`` profiler range per part module; the
    handles (``.remove()`` them when done)."""
    handles = []
    for name, module in model.named_modules():
        part = forward_part(name)
        if part is None:
            continue
        stack: list[Any] = []

        def pre(_m, _a, part=part, stack=stack):
            ctx = torch.profiler.record_function(f"qrl::{part}")
            ctx.__enter__()
            stack.append(ctx)

        def post(_m, _a, _o, stack=stack):
            if stack:
                stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles


def _part_of(event: Any) -> str:
    """The part of the nearest enclosing range / autograd node / optimizer of ``event``."""
    node, in_backward_recompute, first = event, False, None
    while node is not None:
        name = node.name
        if first is None:
            if name.startswith("qrl::"):
                first = name[5:]
            elif name.startswith("autograd::engine::evaluate_function: "):
                node_name = name.split(": ", 1)[1]
                if "Checkpoint" not in node_name:
                    first = backward_part(node_name)
            elif "Optimizer" in name or "optimizer" in name:
                first = "optimizer"
        if "CheckpointFunctionBackward" in name:
            in_backward_recompute = True
        node = node.cpu_parent
    if first is None:
        return "other"
    return f"recompute:{first}" if in_backward_recompute and first in _FORWARD else first


def breakdown(fn: Callable[[], Any], model: torch.nn.Module) -> dict[str, Any]:
    """Run ``fn`` once under the profiler with :func:`add_ranges` on ``model``; GPU kernel
    milliseconds per part, the GPU busy total and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    handles = add_ranges(model)
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=acts) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t) * 1e3
    finally:
        for h in handles:
            h.remove()
    parts, host, kernels = charge(prof.events(), cuda, kineto_links(prof))
    busy = sum(parts.values())
    top = sorted(host.items(), key=lambda kv: -kv[1])[:12]
    top_k = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
    return {"wall_ms": round(wall_ms, 1), "gpu_busy_ms": round(busy, 1),
            "gpu_kernels_ms": round(sum(kernels.values()), 1),
            "unlinked_ms": round(parts.get(UNLINKED, 0.0), 1),
            "parts_ms": {k: round(v, 2) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
            "host_top_ms": {k[:80]: round(v, 2) for k, v in top},
            "kernels_top_ms": {f"{i:02d} {k[:100]}": round(v, 2) for i, (k, v) in enumerate(top_k)}}


UNLINKED = "other (no launching op)"
"""The part of a device kernel whose launching CPU op was not found: the link failed, not the
naming (:func:`charge`)."""

_CPU = torch.autograd.DeviceType.CPU


def kineto_links(prof: Any) -> dict[tuple[int, str, bool], int]:
    """``(id, name, on device) -> linked correlation id`` of a profile's raw Kineto events that
    have one (kernels, memcpys, and the CUDA runtime calls that launched them).

    torch's ``_KinetoEvent.linked_correlation_id()`` is the id of the CPU op a kernel or runtime
    call belongs to; ``FunctionEvent`` exposes it only from torch 2.12 on (torch 2.11's events
    lack the attribute, so every kernel looked unlinked). A ``FunctionEvent`` has its raw
    event's ``correlation_id()`` as ``id`` and its name (only ``ProfilerStep#N`` is rewritten),
    so ``(id, name, device)`` finds the raw event again: a kernel and its runtime call share the
    CUDA correlation id but not the device; a CPU op sharing the number has another name."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    return links_of(results.events() if results is not None else [])


def links_of(raw: Any) -> dict[tuple[int, str, bool], int]:
    """:func:`kineto_links` of raw Kineto events (objects with ``correlation_id()``,
    ``linked_correlation_id()``, ``name()``, ``device_type()``)."""
    out = {}
    for e in raw:
        linked = e.linked_correlation_id()
        if linked > 0:
            out[(e.correlation_id(), e.name(), e.device_type() != _CPU)] = linked
    return out


def linked_id(ev: Any, links: dict[tuple[int, str, bool], int]) -> int:
    """The correlation id of the CPU op that ``ev`` (a kernel or runtime call) belongs to; 0 for
    a frontend op or range. The ``FunctionEvent`` attribute where torch has it, else
    :func:`kineto_links`."""
    linked = getattr(ev, "linked_correlation_id", None)
    if linked is None:
        linked = links.get((ev.id, ev.name, ev.device_type != _CPU), 0)
    return linked


def _is_range_span(ev: Any) -> bool:
    """A ``record_function`` range's or annotation's span on the GPU timeline, not a kernel."""
    return bool(getattr(ev, "is_user_annotation", False)) or ev.name.startswith(
        ("qrl::", "Optimizer.", "ProfilerStep"))


def _depth(ev: Any) -> int:
    d = 0
    while ev.cpu_parent is not None:
        ev, d = ev.cpu_parent, d + 1
    return d


def charge(events: Any, cuda: bool, links: dict[tuple[int, str, bool], int] | None = None
           ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """``(ms per part, own CPU ms per host op, ms per kernel name)`` of a profile's events.

    On CUDA each device kernel record is charged once, to the part of the CPU op that launched
    it: the frontend event whose id is the kernel's linked correlation id (:func:`linked_id`:
    the link torch's profiler itself uses to list an op's kernels), the deepest one if several
    share the id. The parts then add up to the kernels' own total (``gpu_kernels_ms``); a kernel
    whose op is not found goes to :data:`UNLINKED`. Charging each CPU event's ``kernels`` list
    instead counted kernels more than once on the H200 (1,412 ms of parts for 290 ms of
    kernels). Without CUDA each op's own CPU time is charged (checks the attribution on a CPU;
    not a speed measurement)."""
    links = links or {}
    parts: dict[str, float] = {}
    host: dict[str, float] = {}
    kernels: dict[str, float] = {}
    launchers: dict[int, Any] = {}
    device = []
    for ev in events:
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if not _is_range_span(ev):
                device.append(ev)
            continue
        if not ev.name.startswith("qrl::"):
            host[ev.name] = host.get(ev.name, 0.0) + ev.self_cpu_time_total / 1e3
        if cuda:
            if not linked_id(ev, links):  # a frontend op / range, not a runtime call
                best = launchers.get(ev.id)
                if best is None or _depth(ev) > _depth(best):
                    launchers[ev.id] = ev
        elif ev.self_cpu_time_total > 0:
            part = _part_of(ev)
            parts[part] = parts.get(part, 0.0) + ev.self_cpu_time_total / 1e3
    for k in device:
        ms = (k.time_range.end - k.time_range.start) / 1e3
        kernels[k.name] = kernels.get(k.name, 0.0) + ms
        op = launchers.get(linked_id(k, links) or -1)
        part = _part_of(op) if op is not None else UNLINKED
        sub = kernel_part(k.name)
        part = f"{part}/{sub}" if sub else part
        parts[part] = parts.get(part, 0.0) + ms
    return parts, host, kernels


def kernel_part(name: str) -> str | None:
    """The aligned-forward sub-part of GPU kernel ``name`` (:data:`KERNEL_PARTS`), or None."""
    for pattern, part in KERNEL_PARTS:
        if re.search(pattern, name):
            return part
    return None


def table(rows: list[dict[str, Any]], layers: int, key: str = "breakdown") -> str:
    """Markdown: one column per row's ``key`` breakdown (``row`` names it), one line per part,
    ms per micro batch and, for the layer parts, ms per layer in brackets."""
    rows = [r for r in rows if key in r]
    parts: list[str] = []
    for r in rows:
        for p in r[key]["parts_ms"]:
            if p not in parts:
                parts.append(p)
    per_layer = _FORWARD | {p for _, p in BACKWARD_PARTS}
    head = "| part | " + " | ".join(r["row"] for r in rows) + " |"
    lines = [head, "|" + "---|" * (len(rows) + 1)]
    for p in parts:
        cells = []
        for r in rows:
            ms = r[key]["parts_ms"].get(p)
            base = p.split(":")[-1].split("/")[0]
            cells.append("" if ms is None else (
                f"{ms:.1f} ({ms / layers:.2f}/layer)" if base in per_layer
                and base not in ("lm_head", "embedding", "optimizer", "other") else f"{ms:.1f}"))
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    for stat in ("gpu_busy_ms", "wall_ms"):
        lines.append(f"| **{stat}** | " + " | ".join(str(r[key][stat]) for r in rows) + " |")
    lines += [f"ATTRIBUTION FAILED for {r['row']}: {why}" for r in rows
              if (why := attribution_failed(r[key]))]
    return "\n".join(lines)


def attribution_failed(b: dict[str, Any], share: float = 0.5) -> str | None:
    """Why a breakdown's parts cannot be read (more than ``share`` of its time in ``other``,
    kernels whose launching op was not found counted with it), or None."""
    parts = b["parts_ms"]
    total = sum(parts.values())
    other = sum(ms for p, ms in parts.items() if p.split("/")[0] in ("other", UNLINKED))
    if not total or other <= share * total:
        return None
    unlinked = sum(ms for p, ms in parts.items() if p.split("/")[0] == UNLINKED)
    return (f"{other / total:.0%} of {total:.1f} ms in `other`"
            + (f", {unlinked:.1f} ms of kernels found no launching CPU op (the profiler's "
               "kernel -> op link)" if unlinked else ", no part range encloses the ops"))
