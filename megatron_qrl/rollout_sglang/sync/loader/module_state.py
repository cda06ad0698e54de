"""A post-processed SGLang module's kernel state, and its checkpoint-layout parameters.

Helpers of the in-place loader (:mod:`.packed`), read from SGLang 0.5.17's
``sglang/srt/layers/linear.py`` and ``moe/fused_moe_triton/layer.py``: which objects hold a
module's tensors (the module, its ``quant_method`` and ``scheme``), taking them off and
putting them back, and re-creating the parameters ``quant_method.create_weights`` made at
init (the checkpoint layout ``model.load_weights`` writes into).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

# flags a post-processing step sets to skip itself when run twice (compressed-tensors
# WNA16 MoE); cleared while the module is re-processed, restored after
_PROCESSED_FLAGS = ("is_marlin_converted", "is_triton_converted")


# ---- module state --------------------------------------------------------------------
@dataclass
class OwnerState:
    params: dict = field(default_factory=dict)
    buffers: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)
    flags: dict = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {**self.attrs, **self.buffers, **self.params}


def state_owners(module: torch.nn.Module) -> list[object]:
    """Objects whose tensors make up a module's kernel state (module, quant method, scheme)."""
    out: list[object] = []
    for o in (module, getattr(module, "quant_method", None), getattr(module, "scheme", None)):
        if o is not None and all(o is not x for x in out):
            out.append(o)
    return out


def detach(owner: object) -> OwnerState:
    """Take every tensor (and processed flag) off ``owner``; returns them."""
    st = OwnerState()
    d = vars(owner)
    if isinstance(owner, torch.nn.Module):
        st.params, st.buffers = dict(owner._parameters), dict(owner._buffers)
        owner._parameters.clear()
        owner._buffers.clear()
    st.attrs = {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}
    st.flags = {k: d[k] for k in _PROCESSED_FLAGS if k in d}
    for k in (*st.attrs, *st.flags):
        del d[k]
    return st


def attach(owner: object, st: OwnerState) -> None:
    if isinstance(owner, torch.nn.Module):
        owner._parameters.update(st.params)
        owner._buffers.update(st.buffers)
    vars(owner).update(st.attrs)
    vars(owner).update(st.flags)


def device_of(states: list[OwnerState]) -> torch.device:
    for st in states:
        for t in st.tensors().values():
            if t is not None:
                return t.device
    return torch.device("cpu")


_EMPTY = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}


class _ZeroFilledEmpty(TorchFunctionMode):
    """``torch.empty`` & co. return zeros: a re-created parameter no load writes holds zeros.

    ``create_weights`` allocates with bare ``torch.empty``, and some of what it makes is a
    placeholder neither ``load_weights`` nor ``process_weights_after_loading`` writes on every
    kernel backend — ModelOpt NVFP4's ``w13/w2_blockscale_swizzled`` is the swizzle of an
    EMPTY scale, re-derived only on the CUTLASS/TRTLLM paths, never on Hopper's Marlin path
    (``modelopt_quant.py`` in 0.5.17). Copied into the live tensor after each sync, that
    placeholder carried whatever memory the allocator handed back, so two syncs of the same
    weights left different engine bits (measured with H200 state digests). Zeros are
    one possible value of uninitialised memory, so nothing that was correct becomes wrong.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY and isinstance(out, torch.Tensor):
            with torch.no_grad():
                out.zero_()
        return out


@contextlib.contextmanager
def creation_context(device: torch.device, dtype: torch.dtype | None):
    """Device and default dtype as during SGLang's model init (``create_weights`` allocates
    with bare ``torch.empty``), and zero-filled allocations (:class:`_ZeroFilledEmpty`)."""
    old = torch.get_default_dtype()
    if dtype is not None and dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _ZeroFilledEmpty():
            yield
    finally:
        torch.set_default_dtype(old)


def _is_a(module: torch.nn.Module, cls_name: str) -> bool:
    return any(c.__name__ == cls_name for c in type(module).__mro__)


def _v2_loader_methods() -> list[str]:
    try:
        from sglang.srt.layers.linear import WEIGHT_LOADER_V2_SUPPORTED
    except ImportError:  # CPU tests: fake modules expose only ``weight_loader``
        return []
    return list(WEIGHT_LOADER_V2_SUPPORTED)


def create_checkpoint_params(module: torch.nn.Module) -> None:
    """Register the checkpoint-layout parameters on ``module`` exactly as its ``__init__``
    did (``sglang/srt/layers/linear.py``, ``moe/fused_moe_triton/layer.py`` in 0.5.17)."""
    qm = module.quant_method
    if hasattr(module, "num_local_experts"):  # FusedMoE
        qm.create_weights(
            layer=module, num_experts=module.num_local_experts,
            hidden_size=module.hidden_size,
            intermediate_size_per_partition=module.intermediate_size_per_partition,
            params_dtype=module.params_dtype, weight_loader=module.weight_loader,
            with_bias=getattr(module, "with_bias", False),
            moe_intermediate_size=(module.intermediate_size_per_partition
                                   * getattr(module, "moe_tp_size", 1)))
        return
    kwargs = dict(
        layer=module,
        input_size_per_partition=getattr(module, "input_size_per_partition", module.input_size),
        output_partition_sizes=list(getattr(module, "output_partition_sizes",
                                            [module.output_size])),
        input_size=module.input_size, output_size=module.output_size,
        params_dtype=module.params_dtype, weight_loader=module.weight_loader)
    if _is_a(module, "ColumnParallelLinear"):
        kwargs["skip_block_quant_check"] = True  # checked at init; the shapes are unchanged
        kwargs["input_size_per_partition"] = module.input_size
    v2 = getattr(module, "weight_loader_v2", None)
    if (v2 is not None and not _is_a(module, "ReplicatedLinear")
            and type(qm).__name__ in _v2_loader_methods()):
        kwargs["weight_loader"] = v2
    qm.create_weights(**kwargs)


def needs_reload(module: torch.nn.Module | None) -> bool:
    """True for a module whose quant method post-processes its weights after loading."""
    qm = getattr(module, "quant_method", None)
    return qm is not None and not type(qm).__name__.startswith("Unquantized") and hasattr(
        qm, "process_weights_after_loading") and hasattr(qm, "create_weights")
