"""Helpers of the quantize-once tests (no tests here): byte equality of packed tensors and a
count of every weight quantization."""

from __future__ import annotations

import contextlib

import torch

from megatron_qrl.quant.spec_core import SpecCore


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (1-byte floats compared as bytes)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


@contextlib.contextmanager
def counting_quantizer(calls: list[str]):
    """Count every weight quantization (the reference quantizer and its fake-quant fast path)
    while inside."""
    saved = SpecCore.quantize_weight, SpecCore.quantize_dequantize

    def quantize_weight(self, w, **kw):
        calls.append("quantize_weight")
        return saved[0](self, w, **kw)

    def quantize_dequantize(self, w, **kw):
        calls.append("quantize_dequantize")
        return saved[1](self, w, **kw)

    SpecCore.quantize_weight, SpecCore.quantize_dequantize = quantize_weight, quantize_dequantize
    try:
        yield calls
    finally:
        SpecCore.quantize_weight, SpecCore.quantize_dequantize = saved
