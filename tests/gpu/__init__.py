"""GPU tests: run on the H200 device machine, skipped elsewhere with the reason."""

from __future__ import annotations


def skip_unless_sglang_gpu(what: str) -> None:
    """Skip the calling test module unless a CUDA GPU and an importable SGLang are present."""
    import pytest
    import torch

    from megatron_qrl.utils.optional import available

    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA GPU: {what} run on the H200 device only", allow_module_level=True)
    ok, why = available("sglang")
    if not ok:
        pytest.skip(f"SGLang not importable here ({why})", allow_module_level=True)
