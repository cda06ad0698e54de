"""The fp8_block real GEMM: SGLang's own block-FP8 kernels, called as SGLang's linear calls them.

SGLang's FP8 block linear on Hopper with DeepGEMM off (``SGLANG_ENABLE_JIT_DEEPGEMM=0``, our
H200 recipe) is ``fp8_utils.triton_w8a8_block_fp8_linear``:

    q_input, x_scale = per_token_group_quant_fp8(input_2d, block_size[1],
                                                 column_major_scales=False)
    output = w8a8_block_fp8_matmul_triton(q_input, weight, x_scale, weight_scale,
                                          block_size, output_dtype=input_2d.dtype)

with ``weight`` the float8_e4m3fn codes ``[N, K]`` (contiguous) and ``weight_scale`` the
``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]`` fp32 multipliers the weight sync sends
(``fp8_block``'s :class:`~megatron_qrl.quant.QuantizedWeight`); ``x_scale`` is row-major
``[M, K/128]``. The Triton GEMM accumulates in fp32, per K block of 128,
``acc += (qx_blk @ qw_blk^T) * sx[m, kb] * sw[nb, kb]`` (DeepSeek-AI 2024, DeepSeek-V3
technical report sec. 3.3.2, fine-grained quantization), and rounds to the output dtype once.
Calling the same two functions on the same codes makes the training forward equal the
rollout's GEMM by construction. The module is found under SGLang 0.5.17's
``sglang.kernels.ops.quantization.fp8_kernel`` (older releases:
``sglang.srt.layers.quantization.fp8_kernel``).
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from types import ModuleType

import torch

MODULES = ("sglang.kernels.ops.quantization.fp8_kernel",
           "sglang.srt.layers.quantization.fp8_kernel")
"""Where SGLang keeps ``per_token_group_quant_fp8`` / ``w8a8_block_fp8_matmul_triton``."""
NAMES = ("per_token_group_quant_fp8", "w8a8_block_fp8_matmul_triton")


@lru_cache(maxsize=1)
def _load() -> tuple[ModuleType | None, str]:
    errors = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 -- any import failure means "not available"
            errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        missing = [n for n in NAMES if not hasattr(mod, n)]
        if missing:
            errors.append(f"{name} lacks {', '.join(missing)}")
            continue
        return mod, name
    return None, "; ".join(errors)


def sglang_kernels() -> ModuleType:
    """SGLang's ``fp8_kernel`` module; ``ImportError`` with one line saying why not."""
    mod, why = _load()
    if mod is None:
        raise ImportError(f"SGLang's block-FP8 kernels do not import ({why})")
    return mod


def sglang_available() -> tuple[bool, str]:
    """(SGLang's block-FP8 kernels import here, which module or why not)."""
    mod, why = _load()
    return mod is not None, why


def quantize_act_groups(spec, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's activation quantization of ``[M, K]``: E4M3 codes ``[M, K]`` and fp32 scales
    ``[M, K / group]`` row-major (``column_major_scales=False``, as its Triton linear)."""
    if x2d.shape[-1] % spec.act_group:
        raise ValueError(f"{spec.name}: activation dim {x2d.shape[-1]} is not a multiple of "
                         f"{spec.act_group}")
    with torch.no_grad():
        return sglang_kernels().per_token_group_quant_fp8(
            x2d.detach().contiguous(), spec.act_group, column_major_scales=False)


def block_scaled_mm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                    out_dtype: torch.dtype, block: tuple[int, int] = (128, 128)
                    ) -> torch.Tensor:
    """SGLang's ``w8a8_block_fp8_matmul_triton(xq, wq, xs, ws, block, out_dtype)``: the codes
    ``xq`` ``[M, K]`` / ``wq`` ``[N, K]`` with group scales ``xs`` ``[M, K/bk]`` and block
    scales ``ws`` ``[ceil(N/bn), ceil(K/bk)]``."""
    if xq.shape[0] == 0:  # an expert without tokens
        return xq.new_zeros((0, wq.shape[0]), dtype=out_dtype)
    return sglang_kernels().w8a8_block_fp8_matmul_triton(
        xq.contiguous(), wq.contiguous(), xs.contiguous(), ws.contiguous(), list(block),
        output_dtype=out_dtype)


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                      ) -> torch.Tensor:
    """``codes.float() * scale`` per group of ``K / scale.shape[-1]`` columns, in ``dtype``:
    the activation operand the straight-through backward multiplies (fp8_block's fake
    activation quantizer's value when the codes and scales are its own)."""
    m, k = codes.shape
    g = scale.shape[-1]
    out = codes.float().view(m, g, k // g) * scale.float().view(m, g, 1)
    return out.view(m, k).to(dtype)
