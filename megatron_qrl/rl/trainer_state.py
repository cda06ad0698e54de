"""What the trainer holds: every tensor reachable from its model and optimizer, by role.

One walk, read by ``rl.trainer_sleep`` (which moves what it finds) and by the tests (which
count what it missed). Roles:

* ``params``: the model's Parameters, megatron-core's ``param_data`` buffers, every module
  buffer (a LoRA run's frozen base, router biases) and every tensor a module holds in an
  attribute, also inside tuples, lists, dicts and dataclasses (RoPE's ``inv_freq``, the
  aligned forward's cached quantized weights). The weight sync reads these.
* ``grads``: the DDP ``grad_data`` buffers, each Parameter's ``main_grad`` and ``.grad``, the
  optimizer's parameters' ``.grad``.
* ``state``: everything reachable from the megatron optimizer(s): the inner torch
  optimizer's parameters (fp32 main parameters) and state (Adam moments), and every tensor
  the megatron wrapper or its grad scaler holds in an attribute (``fp32_from_float16_groups``,
  the distributed optimizer's shard groups, ``found_inf``, the loss scale).

A storage reachable in several roles counts in the first (an fp32 model's optimizer
parameters are its weights). Caches that hold tensors out of reach of the model's attributes
(megatron-core's ``lru_cache`` on RoPE's ``forward``) are dropped, not moved:
:func:`clear_module_caches`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ROLES", "clear_module_caches", "optimizer_members", "trainer_tensors",
           "labelled_tensors"]

ROLES = ("params", "grads", "state")

_LABEL_ROLE = {"param_data": "params", "param": "params", "module tensor": "params",
               "grad_data": "grads", "main_grad": "grads", "grad": "grads",
               "optimizer param": "state", "optimizer tensor": "state"}
"""Each walk's label and the role it belongs to (the labels name rows of an accounting)."""


def optimizer_members(optimizer: Any) -> list[Any]:
    """The megatron-core optimizers inside ``optimizer`` (a ChainedOptimizer's members)."""
    members = getattr(optimizer, "chained_optimizers", None)
    return list(members) if members else [optimizer]


def _tensors_in(value: Any, seen: set[int], walk: tuple[type, ...] = ()) -> Iterator[torch.Tensor]:
    """Tensors in ``value``: itself, or inside tuples, lists, sets, dicts (keys and values),
    dataclass instances and instances of ``walk`` (their attributes); each container once
    (``seen``: their ids)."""
    if torch.is_tensor(value):
        yield value
        return
    if id(value) in seen:
        return
    if isinstance(value, dict):
        items: Any = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    elif walk and isinstance(value, walk):
        items = list(vars(value).values())
    else:
        return
    seen.add(id(value))
    for item in items:
        yield from _tensors_in(item, seen, walk)


def _ddp_buffers(ddp: Any) -> list[Any]:
    return [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]


def _model_tensors(ddp: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for buf in _ddp_buffers(ddp):
        if getattr(buf, "param_data", None) is not None:
            yield "param_data", buf.param_data
    yield from (("param", p) for p in ddp.module.parameters())
    seen: set[int] = set()
    for module in ddp.module.modules():
        for name, value in vars(module).items():
            if name not in ("_parameters", "_modules"):  # walked above / by modules()
                yield from (("module tensor", t) for t in _tensors_in(value, seen))


def _grad_tensors(ddp: Any, optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for buf in _ddp_buffers(ddp):
        if getattr(buf, "grad_data", None) is not None:
            yield "grad_data", buf.grad_data
    for p in ddp.module.parameters():
        for label, g in (("main_grad", getattr(p, "main_grad", None)), ("grad", p.grad)):
            if g is not None:
                yield label, g
    for member in optimizer_members(optimizer):
        for group in getattr(member, "param_groups", []):
            yield from (("grad", p.grad) for p in group["params"] if p.grad is not None)


def _optimizer_types() -> tuple[type, ...]:
    from megatron.core.optimizer.grad_scaler import MegatronGradScaler
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    return torch.optim.Optimizer, MegatronOptimizer, MegatronGradScaler


def _state_tensors(optimizer: Any) -> Iterator[tuple[str, torch.Tensor]]:
    members = optimizer_members(optimizer)
    for member in members:  # the fp32 main params (or an fp32 model's own) first
        inner = getattr(member, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            yield from (("optimizer param", p) for p in group["params"])
    seen: set[int] = set()
    walk = _optimizer_types()
    for member in members:  # Adam moments, masters' other views, scaler, found_inf, ...
        yield from (("optimizer tensor", t) for t in _tensors_in(member, seen, walk))


def labelled_tensors(ddp: Any, optimizer: Any) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(role, label, tensor)`` for every tensor the trainer reaches, ``params`` first, then
    ``grads``, then ``state`` (a tensor may come more than once)."""
    for walk in (_model_tensors(ddp), _grad_tensors(ddp, optimizer), _state_tensors(optimizer)):
        for label, t in walk:
            yield _LABEL_ROLE[label], label, t


def trainer_tensors(ddp: Any, optimizer: Any) -> dict[str, list[torch.Tensor]]:
    """The trainer's tensors by role (``params``, ``grads``, ``state``; module docstring)."""
    out: dict[str, list[torch.Tensor]] = {role: [] for role in ROLES}
    for role, _, t in labelled_tensors(ddp, optimizer):
        out[role].append(t)
    return out


def clear_module_caches(module: torch.nn.Module) -> int:
    """Drop the ``functools.lru_cache`` of every submodule's ``forward`` that has one
    (megatron-core's RoPE caches its embedding per sequence length there, out of reach of the
    module's attributes); the next forward recomputes the same tensors. Returns how many
    caches were cleared (each class's once)."""
    cleared = set()
    for m in module.modules():
        fn = getattr(type(m), "forward", None)
        if hasattr(fn, "cache_clear") and id(fn) not in cleared:
            fn.cache_clear()
            cleared.add(id(fn))
    return len(cleared)
