"""Weights and the bit-for-bit comparison shared by the fused-quantizer tests (Triton's
interpreter on the CPU: tests/quant/test_fused_quant.py; compiled on a GPU:
tests/gpu/test_fused_quant.py)."""

from __future__ import annotations

import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.fused import set_quant_impl

FORMATS = ("int8", "fp8", "fp8_block", "w4a16", "nvfp4")


def weights(fmt: str, device: str = "cpu", seed: int = 0):
    """``(label, weight)`` cases for ``fmt``: fp32 and bf16, rows spread over 10 decades (the edge blocks the smallest), an
    all-zero row, a row below the zero-amax threshold 2^-24, extreme finite rows (near the
    dtype's max, near its smallest normal), exact rounding ties, and a shape that is not a
    multiple of 128 rows (and, where the format allows, columns)."""
    g = torch.Generator().manual_seed(seed)
    cols = 200 if fmt in ("int8", "fp8") else (160 if fmt == "nvfp4" else 384)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (130, 257):
            w = torch.randn(rows, cols, generator=g) * torch.logspace(4, -6, rows)[:, None]
            w[3] = 0.0
            w[4] = 2.0**-26  # below ModelOpt's zero threshold: codes 0
            w[5, :] = torch.finfo(dtype).max / 4 * torch.sign(torch.randn(cols, generator=g))
            w[6] = torch.finfo(dtype).tiny * 8 * torch.randn(cols, generator=g)
            w[7] = torch.arange(cols) * 0.5 - cols / 4  # exact halves: ties after scaling
            w[8, : cols // 2] = -0.0
            w[9] = 2.0**-23 * torch.sign(torch.randn(cols, generator=g))  # just above it
            out.append((f"{dtype}-{rows}x{cols}", w.to(dtype).to(device)))
        out.append((f"{dtype}-ties", ties(fmt, cols).to(dtype).to(device)))
    return out


def fake_weights(fmt: str, device: str = "cpu", seed: int = 0):
    """:func:`weights` and the cases of the fake quantizer's own output rounding: fp16 rows
    spread over 9 decades (dequantized values below fp16's smallest normal 2^-14, some below
    its smallest subnormal: subnormal outputs and their rounding), fp16's max and subnormal
    inputs; bf16 subnormal inputs (codes 0 of either sign) beside normal values of their
    row, block and group; zero blocks / groups, one of them a ragged edge; a weight read
    through a row stride (a column slice of a wider tensor) and a transposed one."""
    g = torch.Generator().manual_seed(seed + 1)
    cols = weights(fmt)[0][1].shape[1]
    out = list(weights(fmt, device, seed))
    h = torch.randn(130, cols, generator=g) * torch.logspace(2, -7, 130)[:, None]
    h[3] = 0.0
    h[4, : cols // 2] = -0.0
    h[5] = 65504.0 * torch.sign(torch.randn(cols, generator=g))
    h[6] = 2.0**-24 * torch.randint(-1000, 1000, (cols,), generator=g)  # fp16 subnormals
    h[128:, :128] = 0.0  # a zero ragged edge block (fp8_block), zero groups
    out.append((f"fp16 130x{cols}", h.half().to(device)))
    b = torch.randn(130, cols, generator=g) * 1e-3
    tiny = torch.finfo(torch.bfloat16).tiny
    b[10:20] = tiny * torch.rand(10, cols, generator=g) * torch.sign(torch.randn(10, cols,
                                                                                 generator=g))
    b[10:20, ::16] = 1e-3  # one normal value per row and per group of 16
    b[128:, :128] = 0.0
    out.append((f"bf16 subnormals 130x{cols}", b.bfloat16().to(device)))
    wide = torch.randn(96, cols + 256, generator=g).bfloat16().to(device)
    out.append(("row-strided", wide[:, 128:128 + cols]))
    out.append(("transposed", torch.randn(cols, 128, generator=g).to(device).t()))
    return out


def fake_quant(fmt: str, w: torch.Tensor, impl: str, global_amax=None, **kw) -> torch.Tensor:
    """``get_spec(fmt).quantize_dequantize(w)`` through ``impl`` (``torch`` / ``triton``)."""
    set_quant_impl(impl)
    try:
        return get_spec(fmt).quantize_dequantize(w, global_amax=global_amax, **kw)
    finally:
        set_quant_impl(None)


def ties(fmt: str, cols: int) -> torch.Tensor:
    """128 rows whose scale is exactly 1 (amax 127 for int8, 448 for fp8 / fp8_block: torch's
    ``reciprocal(amax) * MAX`` is 1 there; group amax 7 for w4a16) and whose other values sit
    on rounding ties: halves for the integer formats, E4M3 midpoints for the fp8 ones, the
    E2M1 midpoints for nvfp4 (whose scales are 1 there)."""
    j = torch.arange(cols)
    if fmt == "int8":
        row = (j % 64) * 0.5 - 16.0
        row[0] = 127.0
    elif fmt in ("fp8", "fp8_block"):
        mids = e4m3_probe()[127:253]  # the 126 midpoints, positive
        row = mids[j % len(mids)] * torch.where(j % 2 == 0, 1.0, -1.0)
        row[0] = 448.0
    elif fmt == "w4a16":
        row = (j % 15) * 0.5 - 3.5
        row[j % 128 == 0] = 7.0
    else:  # nvfp4: tensor amax 2688 = 6 * 448 gives s2 = 1, block amax 6 then s_blk = 1
        t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        row = t[j % 7] * torch.where(j % 2 == 0, 1.0, -1.0)
        row[j % 16 == 0] = 6.0
    w = row.expand(128, cols).clone()
    if fmt == "nvfp4":
        w[0, 0] = 2688.0
    return w


def activations(fmt: str, device: str = "cpu", seed: int = 0):
    """``(label, x)`` inputs of the per-token activation quantizer: bf16 and fp32 tokens over
    12 decades, an all-zero token, one below the int8 floor 1e-10, extreme finite tokens,
    tokens on rounding ties (scale 1: amax 448 / 127 with E4M3 midpoints / halves), a 3-D
    input, a strided (non-contiguous) one, and for fp8 NaN and inf tokens (bit-exact there
    too; int8's codes of non-finite tokens are undefined)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for k in (200, 1024):
            x = torch.randn(67, k, generator=g) * torch.logspace(6, -6, 67)[:, None]
            x[3] = 0.0
            x[4] = 1e-11 * torch.sign(torch.randn(k, generator=g))
            x[5] = torch.finfo(dtype).max / 8 * torch.sign(torch.randn(k, generator=g))
            x[6] = torch.finfo(dtype).tiny * 4 * torch.randn(k, generator=g)
            x[7] = ties(fmt, k)[0]
            x[8, : k // 2] = -0.0
            if fmt == "fp8":
                x[9, 5] = float("nan")
                x[10, 7] = float("-inf")
            out.append((f"{dtype}-67x{k}", x.to(dtype).to(device)))
    x = out[0][1]
    out.append(("3d", x[:66].reshape(2, 33, -1)))
    out.append(("strided", torch.randn(40, 400, generator=g).bfloat16().to(device)[:, ::2]))
    return out


def group_activations(device: str = "cpu", seed: int = 0):
    """``(label, x)`` inputs of fp8_block's 1x128 activation groups: the per-token cases whose
    width is a multiple of 128, and groups (not tokens) zero, below the 1e-10 floor, at the
    E4M3 ties (amax 448: scale 1), NaN, -inf; a 3-D and a strided input."""
    g = torch.Generator().manual_seed(seed)
    out = [(label, x) for label, x in activations("fp8", device, seed)
           if x.shape[-1] % 128 == 0 and x.dim() == 2 and x.is_contiguous()]
    x = torch.randn(9, 512, generator=g) * torch.logspace(4, -4, 9)[:, None]
    x[0, 128:256] = 0.0
    x[1, :128] = 1e-11
    x[2, 256:384] = ties("fp8", 128)[0]
    x[3, 5] = float("nan")
    x[4, 300] = float("-inf")
    for dtype in (torch.bfloat16, torch.float32):
        out.append((f"groups {dtype}", x.to(dtype).to(device)))
    out.append(("3d", out[-2][1].reshape(3, 3, 512)))
    out.append(("strided", torch.randn(16, 512, generator=g).bfloat16().to(device)[::2]))
    return out


def group_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_block's activation codes and scales in torch (``FP8BlockSpec._act`` before its
    dequantization): ``a = max(amax, 1e-10)``, ``e4m3(x * (448 / a))``, ``a * (1 / 448)``."""
    from megatron_qrl.quant.numerics import cast_e4m3

    gx = x.float().reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
    a = torch.clamp(gx.abs().amax(dim=-1, keepdim=True), min=1e-10)
    codes = cast_e4m3(gx * (448.0 / a)).reshape(x.shape)
    return codes, (a * (1.0 / 448.0)).squeeze(-1)


def dequant_cases(device: str = "cpu", seed: int = 0):
    """``(label, codes, scale)``: every E4M3 byte (subnormals, NaN) and every int8 code, rows
    scaled from 2^-30 to 2^30 (bf16 subnormal and overflow-free), and a stacked ``[E, N, K]``
    weight with ``[E, N, 1]`` scales."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-30, 30, 61, base=2.0)[:, None] * (1 + torch.rand(61, 1, generator=g))
    fp8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    int8 = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    stacked = torch.randint(-127, 128, (3, 40, 72), generator=g).to(torch.int8)
    cases = [("fp8 all bytes", fp8.expand(61, 256).contiguous(), scale),
             ("int8 all codes", int8.expand(61, 256).contiguous(), scale),
             ("int8 stacked", stacked, torch.rand(3, 40, 1, generator=g) * 1e-2)]
    return [(label, c.to(device), s.to(device)) for label, c, s in cases]


def fake_act(spec, x: torch.Tensor, impl: str) -> torch.Tensor:
    """``spec.fake_quant_activation(x)`` through ``impl`` (``torch`` / ``triton``)."""
    set_quant_impl(impl)
    try:
        return spec.fake_quant_activation(x)
    finally:
        set_quant_impl(None)


def quantize_act(fmt: str, x: torch.Tensor, impl: str):
    """``get_spec(fmt).quantize_activation(x)`` (codes, scales) through ``impl``."""
    set_quant_impl(impl)
    try:
        return get_spec(fmt).quantize_activation(x)
    finally:
        set_quant_impl(None)


def quantize(fmt: str, w: torch.Tensor, impl: str, global_amax=None):
    """``get_spec(fmt).quantize_weight(w)`` and its packed tensors, through ``impl``."""
    spec = get_spec(fmt)
    set_quant_impl(impl)
    try:
        q = spec.quantize_weight(w, global_amax=global_amax)
        return q, spec.pack_quantized("model.layers.0.mlp.down_proj.weight", q)
    finally:
        set_quant_impl(None)


def assert_pack_streams_equal(fmt: str, stream) -> None:
    """``pack_state_dict`` of ``stream`` (expert-stacked wire) through the fused kernels equals
    the torch reference's: names, order, dtypes, shapes and bits."""
    spec = get_spec(fmt)
    out = {}
    for impl in ("torch", "triton"):
        set_quant_impl(impl)
        try:
            out[impl] = [(n, t.clone()) for n, t in spec.pack_state_dict(iter(stream),
                                                                         stack_experts=True)]
        finally:
            set_quant_impl(None)
    assert [n for n, _ in out["triton"]] == [n for n, _ in out["torch"]]
    for (n, a), (_, b) in zip(out["triton"], out["torch"]):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.equal(bits(a), bits(b)), n


def bits(t: torch.Tensor | None, device: torch.device | str | None = None):
    """``t``'s bit pattern as an integer tensor (compares -0.0, NaN, float8), on ``device``
    (default: its own)."""
    if t is None:
        return None
    t = t.detach().to(device or t.device).contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) \
        if t.element_size() == 4 else t.view(torch.int16) if t.element_size() == 2 else t


def assert_same(fused, ref, label: str) -> None:
    """Same codes, scales, tensor scale, shape, dtypes and packed tensors, bit for bit."""
    (q, packed), (r, rpacked) = fused, ref
    for what in ("codes", "scale", "global_scale"):
        a, b = getattr(q, what), getattr(r, what)
        assert (a is None) == (b is None), f"{label}: {what} present on one side only"
        if a is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{label}: {what} {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        diff = (bits(a) != bits(b, a.device)).sum().item()
        assert diff == 0, f"{label}: {diff} of {a.numel()} {what} differ"
    assert (q.shape, q.dtype, q.spec) == (r.shape, r.dtype, r.spec), label
    assert [n for n, _ in packed] == [n for n, _ in rpacked], label
    for (n, a), (_, b) in zip(packed, rpacked):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{label}: packed {n}"
        assert torch.equal(bits(a), bits(b, a.device)), f"{label}: packed {n} differs"


def e4m3_probe(device: str = "cpu") -> torch.Tensor:
    """Every E4M3 value, every midpoint between neighbours (a tie: to even) and the fp32
    neighbours of each midpoint, both signs."""
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, torch.nextafter(mids, mids * 2), torch.nextafter(mids, -mids),
                   torch.tensor([2.0**-10, 2.0**-20, 0.0])])
    return torch.cat([x, -x]).to(device)


def assert_bits_equal(a, b, label):
    """Bit-equal, except that NaNs need only be NaNs: an E4M3 NaN may carry either sign (the
    sign of ``NaN * NaN`` is the operand order the compiler chose), a float NaN any payload."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{label}: {a.dtype}{tuple(a.shape)} " \
        f"!= {b.dtype}{tuple(b.shape)}"
    ba, bb = bits(a), bits(b)
    if a.dtype == torch.float8_e4m3fn:
        ba, bb = (torch.where((t & 0x7F) == 0x7F, 0x7F, t) for t in (ba, bb))
    elif a.is_floating_point():
        ba, bb = (torch.where(t.isnan(), -1, u) for t, u in ((a, ba), (b, bb)))
    diff = (ba != bb).sum().item()
    assert diff == 0, f"{label}: {diff} of {a.numel()} differ"


def act_through_real_linear(fmt: str, device: str) -> None:
    """The real linear and the grouped real linear with the fused operand kernels equal the
    torch operands' outputs and gradients (input and weight) bit for bit."""
    from megatron_qrl.te_quant.real_gemm import (
        grouped_real_linear,
        real_linear,
        stacked_weight_operand,
        weight_operand,
    )

    spec = get_spec(fmt)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, 96, generator=g).bfloat16().to(device)
    w = (torch.randn(3, 48, 96, generator=g) * 0.05).bfloat16().to(device)
    gy = torch.randn(2, 24, 48, generator=g).bfloat16().to(device)
    counts = [20, 0, 28]
    out = {}
    for impl in ("torch", "triton"):
        set_quant_impl(impl)
        try:
            xd, wd = x.clone().requires_grad_(), w[0].clone().requires_grad_()
            y = real_linear(xd, wd, weight_operand(spec, w[0]), spec)
            y.backward(gy)
            xg, wg = x.reshape(48, 96).clone().requires_grad_(), w.clone().requires_grad_()
            qw = stacked_weight_operand(spec, list(w), 0, None, "w")
            yg = grouped_real_linear(xg, [wg], qw, spec, counts)
            yg.backward(gy.reshape(48, 48))
            out[impl] = [y, xd.grad, wd.grad, yg, xg.grad, wg.grad]
        finally:
            set_quant_impl(None)
    for i, (a, b) in enumerate(zip(out["triton"], out["torch"])):
        assert_bits_equal(a.detach(), b.detach(), f"{fmt} real linear tensor {i}")


def grad_cases(device: str = "cpu", seed: int = 0):
    """``(label, g, sw, sx)`` inputs of the FP8 backward's gradient quantizers: BF16 and fp32
    gradients ``[M, N]`` whose rows span 12 decades, with per-channel weight scales ``sw``
    ``[N]`` and per-token activation scales ``sx`` ``[M, 1]``; an all-zero row and column, rows
    and columns on E4M3 rounding ties (amax 448, scales 1), a NaN and an inf element (bit-exact
    there too), a strided gradient (row stride > N)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for m, n in ((67, 200), (130, 72)):
            x = torch.randn(m, n, generator=g) * torch.logspace(4, -8, m)[:, None]
            sw = torch.rand(n, generator=g) * 1e-2 + 1e-4
            sx = torch.rand(m, 1, generator=g) * 1e-1 + 1e-3
            x[3] = 0.0
            x[:, 5] = 0.0
            x[7] = ties("fp8", n)[0]
            sw[:] = torch.where(torch.arange(n) % 3 == 0, 1.0, sw)
            sx[7] = 1.0
            x[8, : n // 2] = -0.0
            x[9, 6] = float("nan")
            x[10, 8] = float("-inf")
            out.append((f"{dtype}-{m}x{n}", x.to(dtype).to(device), sw.to(device), sx.to(device)))
    wide = torch.randn(40, 160, generator=g).bfloat16().to(device)
    out.append(("strided", wide[:, :150], (torch.rand(150, generator=g) * 1e-2).to(device),
                torch.rand(40, 1, generator=g).to(device)))
    return out


def fp8_backward_through_real_linear(device: str) -> dict[str, int]:
    """The real linear and the grouped real linear (fp8) with the FP8 input and weight gradients
    give the same outputs and gradients bit for bit through the fused gradient quantizers
    (``triton``) as through the torch code; returns how often each kernel ran."""
    from megatron_qrl.quant import triton_grad
    from megatron_qrl.te_quant.real_gemm import (
        grouped_real_linear,
        real_linear,
        stacked_weight_operand,
        weight_operand,
    )

    spec = get_spec("fp8")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, 96, generator=g).bfloat16().to(device)
    w = (torch.randn(3, 48, 96, generator=g) * 0.05).bfloat16().to(device)
    gy = torch.randn(2, 24, 48, generator=g).bfloat16().to(device)
    counts = [20, 0, 28]
    calls = {"quantize_grad_rows": 0, "quantize_grad_cols_t": 0}
    originals = {name: getattr(triton_grad, name) for name in calls}

    def counted(name):
        def run(*a, **kw):
            calls[name] += 1
            return originals[name](*a, **kw)
        return run

    out = {}
    for impl in ("torch", "triton"):
        set_quant_impl(impl)
        for name in calls:
            setattr(triton_grad, name, counted(name))
        try:
            xd, wd = x.clone().requires_grad_(), w[0].clone().requires_grad_()
            y = real_linear(xd, wd, weight_operand(spec, w[0]), spec, grad_fp8="e4m3",
                            wgrad_fp8="e4m3")
            y.backward(gy)
            xg, wg = x.reshape(48, 96).clone().requires_grad_(), w.clone().requires_grad_()
            qw = stacked_weight_operand(spec, list(w), 0, None, "w")
            yg = grouped_real_linear(xg, [wg], qw, spec, counts, grad_fp8="e4m3",
                                     wgrad_fp8="e4m3")
            yg.backward(gy.reshape(48, 48))
            out[impl] = [y, xd.grad, wd.grad, yg, xg.grad, wg.grad]
        finally:
            set_quant_impl(None)
            for name, fn in originals.items():
                setattr(triton_grad, name, fn)
    for i, (a, b) in enumerate(zip(out["triton"], out["torch"])):
        assert_bits_equal(a.detach(), b.detach(), f"fp8 backward tensor {i}")
    return calls
