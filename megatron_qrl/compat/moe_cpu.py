"""Shim: megatron-core 0.16.1 MoE router without Transformer Engine.

Why: ``megatron/core/transformer/moe/moe_utils.py`` imports ``te_general_gemm`` inside a
``try`` that swallows the ImportError, but ``RouterGatingLinearFunction.forward`` /
``backward`` then test ``te_general_gemm is not None``, which raises ``NameError`` when TE
is absent — every MoE forward on a CPU machine fails. Defining the missing module global as
``None`` selects the existing pure-torch branch (``torch.mm`` in ``router_dtype``); nothing
else changes. Versions: needed for megatron-core 0.16.1 (where the bug is); a no-op when the
name exists (TE importable, or a fixed release).
"""

from __future__ import annotations


def enable_moe_router_without_te() -> bool:
    """Define ``moe_utils.te_general_gemm = None`` when TE did not; True if it was missing."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
