"""In-place reload of QuantSpec-packed weights into a running SGLang engine.

Shim for SGLang 0.5.17 (read from its source; ``sglang/srt/layers/quantization``): the
quantized layers' ``process_weights_after_loading`` turns the checkpoint layout into a
kernel layout and often replaces the parameters doing so (w8a8_int8 / w8a8_fp8 store
``weight.t()`` as a new ``Parameter`` without ``weight_loader``; compressed-tensors WNA16
and ModelOpt NVFP4 repack for Marlin into new tensors and a new workspace). A plain
``update_weights_from_tensor`` only calls ``model.load_weights``, which then either fails
("'Parameter' object has no attribute 'weight_loader'") or silently skips the names the
kernel layout no longer has. This loader, registered with ``custom_weight_loader`` and
named as the ``load_format`` of ``update_weights_from_tensor``, reloads each post-processed
module through its own checkpoint path while the LIVE tensors keep their storage, so
captured CUDA graphs stay valid:

1. stash the module's live tensors (its parameters, buffers and tensor attributes, and
   the tensor attributes of its ``quant_method`` and ``scheme``, e.g. a Marlin workspace);
2. re-create the checkpoint-layout parameters with ``quant_method.create_weights`` (the
   arguments recovered from the module, as ``LinearBase`` / ``FusedMoE`` pass them);
3. ``model.load_weights`` routes the HF-named packed tensors (q/k/v and gate/up fusion,
   expert stacking, TP sharding);
4. once all of a module's tensors arrived: ``quant_method.process_weights_after_loading``;
5. ``copy_`` every resulting tensor into the stashed live tensor of the same name (shape
   and dtype must match) and put the live tensors back.

Buckets: a sync is several calls. Between calls every module holds its live tensors; the
checkpoint-layout parameters of a module whose tensors are split across buckets wait in a
per-model pending table (only modules in progress hold a copy). Which modules are complete
is declared by the sender (``sync.sender.StreamTracker``) in a control tensor named
``CONTROL`` in each bucket (:mod:`..protocol`): ``{"begin", "final", "done": {module:
n_tensors}, ...}``; the loader checks the received count of each done module and, on
``final``, that no module is left half-loaded. Modules without post-processing (``Unquantized*`` methods, norms,
embeddings) load directly through ``model.load_weights`` in the same call.

Counts are of WIRE tensors: an expert-stacked tensor (:mod:`..protocol`,
``...experts.*.gate_proj.weight``) counts once on both sides (the tracker's ``done`` and the
loader's ``received``; the phase log's ``tensors``), while the shard-load check of
:func:`_finish` counts per expert (each view is one ``weight_loader`` call, or one counted
load of a batched copy). Stacked tensors load through :mod:`.experts` when the control
message asks for direct loads, else they are unstacked into per-expert views first.

When the sender names a receipt, every bucket's tensors are fingerprinted as they arrived
(after unpacking, before loading) and the final bucket writes the receipt (:mod:`.receipt`);
the engine compares it with what it sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from megatron_qrl.sync.protocol.inplace import (
    CONTROL,
    FLAT,
    RECV,
    InplaceSyncError,
    decode_control,
    module_key,
)
from megatron_qrl.sync.protocol.wire import from_bytes, unflatten

from ..debug import PhaseLog, write_digest
from .experts import load_experts_directly, unstack_all
from .lora_wrappers import base_layers_in_place
from .module_state import (
    OwnerState,
    attach,
    create_checkpoint_params,
    creation_context,
    detach,
    device_of,
    needs_reload,
    state_owners,
)
from .receipt import note_received, write_receipt

__all__ = ["bucket_weights", "expected_loads", "load_packed", "receive_bucket"]

_STATE_ATTR = "_qrl_inplace_pending"


# ---- one module ----------------------------------------------------------------------
@dataclass
class _Pending:
    states: list[OwnerState]
    received: int = 0
    loads: dict[str, int] = field(default_factory=dict)


def _has(owner: object, name: str) -> bool:
    if isinstance(owner, torch.nn.Module) and (name in owner._parameters
                                               or name in owner._buffers):
        return True
    return name in vars(owner)


def _count_loads(param: torch.Tensor, name: str, loads: dict[str, int]) -> None:
    """Wrap ``param``'s weight loader so every call is counted per parameter (catches a
    shard missing from the stream, and names ``load_weights`` skips silently)."""
    prop = isinstance(getattr(type(param), "weight_loader", None), property)
    orig = getattr(param, "_weight_loader" if prop else "weight_loader", None)
    if orig is None:
        return

    loads[name] = 0

    def counted(*args, **kwargs):
        loads[name] += 1
        return orig(*args, **kwargs)

    def add(n: int) -> None:  # calls a batched expert load stands for (.expert_batch)
        loads[name] += n

    counted.__wrapped__, counted.qrl_add_loads = orig, add
    setattr(param, "_weight_loader" if prop else "weight_loader", counted)


def _enter(key: str, module, pending: dict[str, _Pending]) -> list[OwnerState]:
    """Swap ``module`` to its checkpoint layout (new, or the pending one); returns live."""
    owners = state_owners(module)
    live = [detach(o) for o in owners]
    if key in pending:
        for o, st in zip(owners, pending[key].states):
            attach(o, st)
        return live
    entry = _Pending([OwnerState() for _ in owners])
    with creation_context(device_of(live), getattr(module, "params_dtype", None)):
        create_checkpoint_params(module)
    for name, p in module._parameters.items():
        if p is not None:
            _count_loads(p, name, entry.loads)
    # what create_weights does not re-create (a bias, expert maps, a workspace, derived
    # scales) stays visible while loading and processing, as a copy: processing may rebind
    # its ``.data`` (copy_or_rebind_param) or transform it, and live storage must not move
    for o, st in zip(owners, live):
        for name, v in st.tensors().items():
            if v is not None and not _has(o, name):
                _put(o, st, name)
    pending[key] = entry
    return live


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A same-class copy with its own storage and the loader attributes of ``t``."""
    if not isinstance(t, torch.nn.Parameter):
        return t.clone()
    c = torch.Tensor._make_subclass(type(t), t.data.clone(), False)
    vars(c).update(vars(t))
    return c


def _put(owner: object, st: OwnerState, name: str) -> None:
    if name in st.params:
        owner._parameters[name] = _clone(st.params[name])
    elif name in st.buffers:
        owner._buffers[name] = _clone(st.buffers[name])
    else:
        vars(owner)[name] = _clone(st.attrs[name])


def _leave(key: str, module, pending: dict[str, _Pending], live: list[OwnerState],
           process: bool) -> None:
    """Back to the live layout; with ``process``, post-process and copy into live first."""
    owners = state_owners(module)
    try:
        if process:
            module.quant_method.process_weights_after_loading(module)
        new = [detach(o) for o in owners]
        if process:
            for lv, nv in zip(live, new):
                _copy_into_live(key, lv, nv)
            del pending[key]
        else:
            pending[key].states = new
    finally:
        for o, st in zip(owners, live):
            detach(o)
            attach(o, st)


def _copy_into_live(key: str, live: OwnerState, new: OwnerState) -> None:
    fresh = new.tensors()
    for name, lv in live.tensors().items():
        if lv is None:
            continue
        nv = fresh.get(name)
        if nv is None:
            raise InplaceSyncError(
                f"in-place sync of {key}: post-processing produced no tensor {name!r} "
                f"(the running engine holds one of shape {tuple(lv.shape)})")
        if nv is lv:
            continue
        if nv.shape != lv.shape or nv.dtype != lv.dtype:
            raise InplaceSyncError(
                f"in-place sync of {key}.{name}: reloaded tensor is {tuple(nv.shape)} "
                f"{nv.dtype} but the running engine holds {tuple(lv.shape)} {lv.dtype}; the "
                "synced weights do not match the checkpoint the engine was started from")
        lv.data.copy_(nv.data)


# ---- the registered loader -----------------------------------------------------------
def load_packed(model: torch.nn.Module, named_tensors) -> None:
    """SGLang custom weight loader: one bucket of an in-place sync (see the module doc); on a
    LoRA-serving engine with the LoRA wrappers' base layers in place (:mod:`.lora_wrappers`)."""
    with base_layers_in_place(model):
        _load_packed(model, named_tensors)


def _load_packed(model: torch.nn.Module, named_tensors) -> None:
    named = list(named_tensors)
    ctl = [t for n, t in named if n == CONTROL]
    if len(ctl) != 1:
        raise InplaceSyncError(f"in-place sync bucket carries {len(ctl)} control tensors "
                               f"{CONTROL!r}, expected 1 (send buckets with StreamTracker)")
    msg = decode_control(ctl[0])
    log = PhaseLog()
    views = msg.get("views", {})
    with log.phase("unpack"):
        weights = [(n, from_bytes(t, views.get(n))) for n, t in bucket_weights(named, ctl[0].device)]
    with log.phase("receipt"):
        note_received(model, msg, weights)
    pending: dict[str, _Pending] = vars(model).setdefault(_STATE_ATTR, {})
    if msg["begin"] and pending:
        left = sorted(pending)
        pending.clear()
        raise InplaceSyncError(f"in-place sync begins while modules {left} are still "
                               "half-loaded from an earlier sync that did not finish")
    modules = dict(model.named_modules())
    touched: dict[str, int] = {}
    for n, _ in weights:
        key = module_key(n)
        if needs_reload(modules.get(key)):
            touched[key] = touched.get(key, 0) + 1
    with torch.no_grad():
        with log.phase("enter"):
            lives = {k: _enter(k, modules[k], pending) for k in touched}
        try:
            with log.phase("load_weights"):
                # stacked expert tensors load as their per-expert views; never by name
                rest = (load_experts_directly(model, modules, weights, log.counts)
                        if msg.get("direct_experts") else unstack_all(weights))
                model.load_weights(rest)
        finally:
            with log.phase("leave"):
                for k, live in lives.items():
                    pending[k].received += touched[k]
                    _leave(k, modules[k], pending, live, process=False)
        with log.phase("process"):
            for k, n_sent in msg["done"].items():
                if k in pending:
                    _finish(k, modules[k], pending, n_sent, msg["suffixes"])
                elif needs_reload(modules.get(k)):
                    raise InplaceSyncError(f"in-place sync of {k}: declared complete with "
                                           f"{n_sent} tensors but none of them arrived in "
                                           "this sync")
    log.write(msg, len(weights))
    if msg["final"] and pending:
        left = {k: p.received for k, p in pending.items()}
        pending.clear()
        raise InplaceSyncError(f"in-place sync ended with modules never completed "
                               f"(tensors received so far): {left}")
    write_receipt(model, msg)  # after the final bucket, when the sender asked for one
    write_digest(model, msg["final"], needs_reload)  # no-op unless QRL_INPLACE_DIGEST names a file


def bucket_weights(named: list, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The HF-named tensors of one bucket: plain entries, plus a flattened bucket's views
    (:data:`RECV` with :data:`FLAT` in the bucket, or received by broadcast)."""
    plain = [(n, t) for n, t in named if n not in (CONTROL, RECV, FLAT)]
    recv = [decode_control(t) for n, t in named if n == RECV]
    flat = [t for n, t in named if n == FLAT]
    if not recv:
        return plain
    if flat:
        return plain + unflatten(flat[0], recv[0]["meta"])
    return plain + receive_bucket(recv[0], device)


def receive_bucket(msg: dict, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a broadcast bucket (:data:`RECV` message ``{"group", "meta"}``):
    receive the flat buffer from rank 0 of the weight-update group and view it."""
    from megatron_qrl.sync.protocol.wire import bucket_nbytes

    from ....rollout.broadcast import broadcast_from_trainer, find_group

    flat = torch.empty(bucket_nbytes(msg["meta"]), dtype=torch.uint8, device=device)
    broadcast_from_trainer(flat, find_group(msg["group"]))
    return unflatten(flat, msg["meta"])


def expected_loads(module: torch.nn.Module, param_name: str) -> int:
    """Weight-loader calls one parameter gets from a complete checkpoint: one per logical
    shard (q/k/v = 3, gate/up = 2) of a linear; per expert 2 (w13_: gate, up) or 1 (w2_)."""
    if hasattr(module, "num_local_experts"):
        n = int(getattr(module, "num_experts", module.num_local_experts))
        return 2 * n if param_name.startswith("w13_") else n
    return len(getattr(module, "output_partition_sizes", None) or [0])


def _checkpoint_suffix(module: torch.nn.Module, param_name: str) -> str:
    if hasattr(module, "num_local_experts"):
        return re.sub(r"^w(13|2)_", "", param_name)
    return param_name


def _finish(key: str, module, pending: dict[str, _Pending], n_sent: int,
            suffixes: list[str]) -> None:
    entry = pending[key]
    problems = [] if entry.received == n_sent else [
        f"the sender sent {n_sent} tensors, {entry.received} arrived"]
    for name, got in entry.loads.items():
        want = expected_loads(module, name)
        if _checkpoint_suffix(module, name) in suffixes and got != want:
            problems.append(f"{name!r} got {got} of {want} shard loads")
    if problems:
        del pending[key]
        raise InplaceSyncError(
            f"in-place sync of {key}: {'; '.join(problems)} (a tensor is missing from the "
            "stream, or model.load_weights skipped a name it has no parameter for); the "
            "module was left unchanged")
    live = _enter(key, module, pending)
    _leave(key, module, pending, live, process=True)
