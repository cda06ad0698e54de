"""Run megatron-core on CPU with the gloo backend (tests and the CPU default job).

Why: megatron-core assumes a CUDA device in a handful of places that have nothing to do
with the maths — it asks ``torch.cuda.current_device()`` for a device to allocate buffers
on, seeds and forks the *CUDA* RNG for tensor-parallel initialisation and dropout
(``tensor_parallel.random``), builds bookkeeping tensors with ``device="cuda"`` inside the
pipeline schedules, the optimizer and gradient clipping, and the optimizer asserts that
every parameter's ``Tensor.type()`` is ``torch.cuda.*Tensor``. Everything else (the model
with ``use_cpu_initialization=True`` and the local spec, vocab-parallel cross entropy,
tensor-parallel collectives over gloo, the optimizer's local ``multi_tensor_*`` fallback)
runs on CPU unchanged. This module is the ONE shim that bridges those spots; nothing else
in ``megatron_qrl`` patches Megatron or torch.

Versions: written and tested against megatron-core 0.16.1 with torch 2.13 (CPU build); aimed
at >= 0.16.1. It relies only on the names ``torch.cuda.current_device``,
``torch.cuda.manual_seed``, ``torch.cuda.get_rng_state``/``set_rng_state`` and
``megatron.core.tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state``;
``enable_cpu_megatron`` raises a clear error if one of them disappears in a later release.
Not applied, and refused, when CUDA is available.

Use, explicitly and never at import time::

    enable_cpu_megatron()            # idempotent; process-wide; no-op effect on real GPUs
    with cpu_device_mode():          # around model build, schedules and optimizer calls
        ...

``enable_cpu_megatron`` refuses to run when CUDA is available: on a GPU machine nothing
needs bridging and silently moving Megatron to CPU would be a bug.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_MARK = "_megatron_qrl_cpu_shim"
"""Attribute set on every replacement function; holds the original it replaced."""


def _marked(original: Callable, replacement: Callable) -> Callable:
    functools.update_wrapper(replacement, original)
    setattr(replacement, _MARK, original)
    return replacement


def _cpu_current_device() -> str:
    return "cpu"


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all, which stays unpatched
    # (it is a lazy no-op without CUDA).
    torch.default_generator.manual_seed(int(seed))


def _cpu_get_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _patch_targets() -> list[tuple[Any, str, Callable]]:
    from megatron.core.tensor_parallel import random as tp_random

    return [
        (torch.cuda, "current_device", _cpu_current_device),
        (torch.cuda, "manual_seed", _cpu_manual_seed),
        (torch.cuda, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda, "set_rng_state", _cpu_set_rng_state),
        (torch.cuda.random, "get_rng_state", _cpu_get_rng_state),
        (tp_random, "_get_cuda_rng_state", _cpu_get_rng_state),
        (tp_random, "_set_cuda_rng_state", _cpu_set_rng_state),
    ]


def cpu_megatron_enabled() -> bool:
    """True once :func:`enable_cpu_megatron` has patched this process."""
    return hasattr(torch.cuda.current_device, _MARK)


def enable_cpu_megatron() -> None:
    """Route megatron-core's CUDA device and RNG calls to the CPU (idempotent).

    Patches, process-wide: ``torch.cuda.current_device`` -> ``"cpu"``;
    ``torch.cuda.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` and
    ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` -> the CPU
    default generator. Undo with :func:`disable_cpu_megatron`.
    """
    if cpu_megatron_enabled():
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "enable_cpu_megatron(): CUDA is available, so megatron-core should run on the GPU; "
            "the CPU shim is only for machines without CUDA. Do not call it here."
        )
    for owner, name, replacement in _patch_targets():
        if not hasattr(owner, name):
            raise RuntimeError(
                f"enable_cpu_megatron(): `{owner.__name__}.{name}` does not exist in this "
                "torch/megatron-core version; megatron_qrl/compat/cpu.py was written for "
                "megatron-core 0.16.1 — update the shim for this version."
            )
        setattr(owner, name, _marked(getattr(owner, name), replacement))


def disable_cpu_megatron() -> None:
    """Restore every function :func:`enable_cpu_megatron` replaced (idempotent)."""
    for owner, name, _ in _patch_targets():
        current = getattr(owner, name)
        if hasattr(current, _MARK):
            setattr(owner, name, getattr(current, _MARK))


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    # A bare int means a CUDA ordinal to torch factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made inside the mode.

    - ``device="cuda"`` / ``"cuda:N"`` / ``torch.device("cuda")`` / an int ordinal, as a
      keyword of any torch function (factories, ``Tensor.to``, ``Tensor.new_*``) -> ``"cpu"``;
    - ``Tensor.cuda()`` -> the tensor itself; ``Tensor.to("cuda")`` -> no move;
    - ``Tensor.type()`` (no argument) on a CPU tensor -> the matching ``torch.cuda.*Tensor``
      name, so megatron-core's optimizer accepts CPU parameters (its only use of ``type()``).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) >= 2 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Context manager: run megatron-core code on CPU (enables the process-wide patches too).

    Wrap model construction, ``get_forward_backward_func()(...)`` and optimizer
    construction/steps in it. Outside the context torch behaves normally.
    """
    enable_cpu_megatron()
    with _CpuDeviceMode():
        yield
