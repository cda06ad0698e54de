"""``QuantSpec.quantize_into``: a weight (or an expert stack) quantized straight into regions of
tensors it does not own, bit for bit ``QuantSpec.pack``'s tensors, the rest untouched."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.into import row_chunks
from megatron_qrl.sync.protocol.checksums import checksum_parts, checksum_rows

FORMATS = ["fp8", "fp8_block", "int8"]
EDGE = 0.0084228515625
"""A bf16 amax ``a`` whose own element times ``fl(448 / a)`` rounds above 448 in fp32
(448.00003): an E4M3 cast without a clamp must still give 448 there."""


def _bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def _weights(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (0.05 * torch.randn(*shape, generator=g)).to(torch.bfloat16)
    w[..., 3, :] = 0  # a zero row (int8: codes 0, scale 1)
    w[..., 7, :] *= 1e-7  # rows at the zero-amax threshold
    w[..., 9, :5] = torch.tensor([EDGE, -EDGE, EDGE / 2, 0, EDGE / 3], dtype=torch.bfloat16)
    w[..., 9, 5:] = 0
    return w


class Engine:
    """Regions of larger tensors: ``rows`` of dim -2 of a buffer twice as tall, filled with a
    sentinel (a fused parameter's member rows, one half of every expert's ``w13``)."""

    def __init__(self, start, device="cpu"):
        self.start, self.device, self.held = start, device, {}

    def region(self, name, shape, dtype):
        full = list(shape)
        full[-2] = 2 * shape[-2] + self.start
        buf = torch.full(full, 7, dtype=torch.int8, device=self.device).view(dtype) \
            if dtype.itemsize == 1 else torch.full(full, 7.0, dtype=dtype, device=self.device)
        self.held[name] = buf
        return buf.narrow(-2, self.start, shape[-2])

    def untouched(self, name, shape):
        buf = self.held[name]
        rest = torch.cat([buf.narrow(-2, 0, self.start),
                          buf.narrow(-2, self.start + shape[-2], buf.shape[-2] - self.start
                                     - shape[-2])], dim=-2)
        return bool((_bits(rest).float() == (7 if buf.element_size() == 1 else 7.0)).all())


NO_GPU = "needs a GPU (the fused Triton quantizers pack there)"
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("experts,rows", [(0, 384), (3, 200), (2, 256)],
                         ids=["weight", "stack_partial_block", "stack"])
def test_quantize_into_is_pack_bit_for_bit(fmt, experts, rows, device):
    """Catches: a block amax that spans two experts or the partial last block's padding,
    a scale from other expressions than ``_quantize``'s, an E4M3 cast that is not saturated
    where ``fl(w s)`` exceeds 448, int8 zero rows, writes outside the region; on a GPU, torch's
    CUDA ops (``torch.mul(..., out=fp8)``: the cast on store) not giving the bits of the fused
    Triton quantizer ``pack`` runs there."""
    spec = get_spec(fmt)
    k = 256
    if experts:
        name = "model.layers.4.mlp.experts.*.up_proj.weight"
        w = _weights((experts, rows, k)).to(device)
        units = [(f"model.layers.4.mlp.experts.{e}.up_proj.weight", w[e]) for e in range(experts)]
    else:
        name = "model.layers.4.self_attn.k_proj.weight"
        w = _weights((rows, k)).to(device)
        units = [(name, w)]
    eng = Engine(start=128, device=device)
    written = dict(spec.quantize_into(name, w, eng.region))
    for e, (unit, we) in enumerate(units):
        for leaf, want in spec.pack(unit, we):
            key = leaf.replace(f".experts.{e}.", ".experts.*.")
            got = written[key][e] if experts else written[key]
            assert torch.equal(_bits(got), _bits(want)), (leaf, fmt)
    for key, t in written.items():
        assert eng.untouched(key, t.shape), key


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_into_refuses_non_finite_weights_naming_them(fmt):
    w = _weights((2, 128, 256))
    w[1, 5, 6] = float("nan")
    with pytest.raises(ValueError, match=r"experts\.\*\.gate_proj\.weight"):
        get_spec(fmt).quantize_into("model.layers.0.mlp.experts.*.gate_proj.weight", w,
                                    Engine(0).region)


def test_quantize_into_refuses_what_it_cannot_place():
    spec = get_spec("fp8")
    with pytest.raises(ValueError, match=r"must be a 3-D \[E, out, in\] expert stack"):
        spec.quantize_into("model.layers.0.mlp.experts.*.gate_proj.weight",
                           torch.zeros(128, 256, dtype=torch.bfloat16), Engine(0).region)
    with pytest.raises(ValueError, match=r"model\.norm\.weight is not a weight this format"):
        spec.quantize_into("model.norm.weight", torch.zeros(8, 8), Engine(0).region)
    with pytest.raises(ValueError, match=r"fp8_block: .*in_features=200"):
        get_spec("fp8_block").quantize_into("model.layers.0.self_attn.o_proj.weight",
                                            torch.zeros(128, 200), Engine(0).region)


def test_int8_chunks_cover_every_row_once():
    for shape, limit in (((3, 200, 256), 1 << 12), ((3, 200, 256), 10 ** 6), ((2, 5, 7), 1)):
        seen = torch.zeros(shape[:2], dtype=torch.int64)
        for e, r in row_chunks(shape, limit):
            seen[e, r] += 1
            assert (e.stop - e.start) * (r.stop - r.start) * shape[2] <= max(limit, shape[2])
        assert bool((seen == 1).all()), (shape, limit)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32])
def test_fingerprints_of_strided_rows_equal_the_rows_alone(dtype):
    """An expert stack's region of a fused parameter (rows strided, each contiguous) is
    fingerprinted without a copy, with each row's own fingerprint. Catches: words read across
    the gap between rows."""
    full = torch.randn(3, 40, 16).to(dtype)
    half = full[:, 20:]
    assert torch.equal(checksum_rows(half), torch.stack([checksum_parts(x.clone()) for x in half]))
