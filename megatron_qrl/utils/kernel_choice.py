"""Which implementation runs a family of fused Triton kernels: the kernels or the torch code.

Each family (the weight quantizers, the log-prob kernels, the sync's fingerprints) keeps its
torch code as the reference and CPU default and reads its choice from one environment
variable, overridden in-process by a setter:

- ``auto`` (default): the kernels for CUDA tensors when Triton imports, else torch (CPU CI);
- ``torch``: always the reference code (A/B benchmarks);
- ``triton``: always the kernels; one error naming the fix where Triton or a GPU is missing
  (CPU tensors run through Triton's interpreter only under ``TRITON_INTERPRET=1``, the tests'
  mode).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

__all__ = ["IMPLS", "ImplSetting", "import_kernels", "select_kernels"]

IMPLS = ("auto", "torch", "triton")


class ImplSetting:
    """One family's choice: :meth:`set` (in-process, wins) over the variable ``env``."""

    def __init__(self, env: str, noun: str) -> None:
        self.env, self.noun = env, noun
        self._forced: list[str] = []

    def set(self, impl: str | None, where: str) -> None:
        """Choose for this process (None: back to the variable, else auto)."""
        self._forced[:] = [] if impl is None else [self.check(impl, where)]

    def get(self) -> str:
        """The choice in force: the setter's, else the variable's, else auto."""
        return self._forced[0] if self._forced else self.check(os.environ.get(self.env, "auto"),
                                                               self.env)

    def check(self, impl: str, where: str) -> str:
        if impl not in IMPLS:
            raise ValueError(f"{where}={impl!r} is not a {self.noun} implementation; use one "
                             f"of {', '.join(IMPLS)}")
        return impl


def import_kernels(module: str) -> ModuleType | None:
    """``module`` (a Triton kernel module), or None where Triton does not import."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return importlib.import_module(module)


def select_kernels(impl: str, kernels: ModuleType | None, device: torch.device | str,
                   env: str, where: str) -> ModuleType | None:
    """``kernels`` for tensors on ``device`` under choice ``impl``, or None (the torch code).

    Raises where ``triton`` is forced but cannot run, naming ``env`` and the fix; ``where``
    says where the tensors are in that message, ``{device}`` filled in (e.g. "the logits are
    on {device}").
    """
    if impl == "torch":
        return None
    device = torch.device(device)
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if kernels is not None and (device.type == "cuda" or (impl == "triton" and interpreted)):
        return kernels
    if impl == "triton":
        why = "Triton is not installed" if kernels is None else where.format(device=device)
        raise RuntimeError(f"{env}=triton: {why}; the fused kernels need Triton and CUDA "
                           "tensors (TRITON_INTERPRET=1 for CPU tensors); use auto or torch")
    return None
