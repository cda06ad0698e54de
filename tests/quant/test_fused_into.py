"""The fused Triton write of fp8 / int8 / fp8_block codes and scales into an engine's regions
(``triton_quant.quantize_channel_into`` / ``quantize_fp8_block_into``, taken by
``QuantSpec.quantize_into`` where it runs) gives the torch code's bits, run by Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before Triton loads): weights and
expert stacks written into strided regions (a fused parameter's member rows, one half of every
expert's ``w13``), the rest of the region's tensor untouched, and a non-finite weight refused
naming it; fp8_block's kernel gives the pack kernel's codes, scales and amaxes per expert
(non-finite blocks included); the direct writer takes the kernels for every weight it
quantizes.

Run: ``PYTHONPATH=/tmp/triton_site:$PWD pytest tests/quant/test_fused_into.py`` (Triton
installed aside; the shared venv has none, and there the module skips).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.triton_cpu import require_triton_interpreter

require_triton_interpreter("tests/gpu/test_fused_quant.py")

from megatron_qrl.quant import get_spec, triton_quant  # noqa: E402
from megatron_qrl.quant.finite_checks import FiniteChecks  # noqa: E402
from megatron_qrl.quant.fused import set_quant_impl  # noqa: E402
from megatron_qrl.utils.finite import NonFiniteError  # noqa: E402
from tests.quant.fused_cases import weights  # noqa: E402
from tests.quant.test_quantize_into import Engine, _bits, _weights  # noqa: E402

if not triton_quant._SOFT:
    pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set; run this module alone",
                allow_module_level=True)

STACK = "model.layers.4.mlp.experts.*.up_proj.weight"
ONE = "model.layers.4.self_attn.k_proj.weight"


FORMATS = ["fp8", "int8", "fp8_block"]


@pytest.fixture
def launches(monkeypatch):
    """Calls of the fused writes (the tests compare them with the torch code: they must run)."""
    seen = []

    def spy(real):
        def call(*args):
            seen.append(args[1].shape)
            return real(*args)
        return call

    for name in ("quantize_channel_into", "quantize_fp8_block_into"):
        monkeypatch.setattr(triton_quant, name, spy(getattr(triton_quant, name)))
    yield seen
    set_quant_impl(None)


def _block_cases():
    """fp8_block's own stacks: zero blocks (whole and a partial edge), a block below the
    zero-amax threshold, an outlier block, fp32, a single partial block of rows, and a stack
    read through strides (every other expert, a column window of a wider tensor)."""
    w = _weights((3, 200, 256))
    w[0, :128, :128] = 0
    w[2, 128:, 128:] = 0  # a zero partial edge block
    w[1, 128:, :128] = 2.0**-26  # below the zero-amax threshold: codes 0
    w[1, 130, 200] = 3e4  # an outlier: its block's other codes flush to 0 / subnormals
    wide = _weights((6, 130, 512), seed=3)
    jitter = 1 + 1e-3 * torch.rand(w.shape, generator=torch.Generator().manual_seed(5))
    return [(STACK, w), (STACK, w.float() * jitter), (STACK, _weights((2, 16, 128), seed=1)),
            (STACK, wide[::2, :, 128:384]), (ONE, _weights((130, 256), seed=2))]


def _into(fmt, name, w, impl, start=128):
    set_quant_impl(impl)
    eng = Engine(start=start)
    written = dict(get_spec(fmt).quantize_into(name, w, eng.region))
    assert all(eng.untouched(k, t.shape) for k, t in written.items()), (fmt, impl)
    return {k: _bits(t) for k, t in written.items()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_write_equals_the_torch_write(fmt, launches):
    """Catches: a scale or code stored at another stride than the region's (an expert's rows
    past the first expert, the scales' expert stride), an expert's amax taken over another
    expert's rows, codes that differ from the torch write (zero rows, the E4M3 saturation at
    448, int8 rounding ties); fp8_block: no fused write (the old code: no launch), a block
    amax over the next block's rows (the row mask of the partial block dropped), the input's
    expert stride taken from the codes' (``e * sc_e`` for ``e * sw_e`` in the load)."""
    if fmt == "fp8_block":
        cases = _block_cases()
    else:
        cases = [(STACK, _weights((3, 200, 256))), (STACK, _weights((2, 16, 40), seed=1)),
                 (ONE, _weights((130, 256), seed=2))]
    cases += [(ONE, w) for _, w in weights(fmt)]
    for name, w in cases:
        got, want = _into(fmt, name, w, "triton"), _into(fmt, name, w, "torch", start=3)
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k], want[k]), (fmt, name, tuple(w.shape), k)
    assert len(launches) == len(cases)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_write_refuses_a_non_finite_weight_naming_it(fmt, launches):
    """Fails on the old code for fp8_block (no fused write: no launch)."""
    w = _weights((2, 32, 128))
    w[1, 5, 6] = float("inf")
    set_quant_impl("triton")
    finite = FiniteChecks()
    get_spec(fmt).quantize_into(STACK, w, Engine(0).region, finite)
    with pytest.raises(NonFiniteError, match=r"experts\.\*\.up_proj\.weight"):
        finite.check(get_spec(fmt))
    w[1, 5, 6] = float("nan")
    with pytest.raises(ValueError, match=r"experts\.\*\.up_proj\.weight"):
        get_spec(fmt).quantize_into(STACK, w, Engine(0).region)
    assert len(launches) == 2


def test_fp8_block_into_kernel_is_the_pack_kernel_per_expert():
    """``quantize_fp8_block_into`` on a stack equals ``quantize_fp8_block`` on each expert:
    codes, ``weight_scale_inv`` and block amaxes, bit for bit, NaN / Inf blocks included (the
    kernels' one shared tile), bf16 and fp32, scales written through a transposed region.
    Catches: the scale's column stride ignored (``bk`` for ``bk * ss_c``), an amax row past
    the expert's (``bn * kb + bk``), a kernel of its own whose non-finite blocks differ."""
    spec = get_spec("fp8_block")
    for dtype in (torch.bfloat16, torch.float32):
        w = _weights((3, 257, 384), seed=4).to(dtype)
        w[0, 5, 6], w[1, 200, 300], w[2, 0, 0] = float("nan"), float("inf"), float("-inf")
        w[2, 130, 10] = 3e4
        codes = torch.full((3, 257, 384), 7, dtype=torch.int8).view(torch.float8_e4m3fn)
        scale = torch.full((3, 3, 3), 7.0).transpose(1, 2)  # [E, nb, kb], column stride 3
        amax = triton_quant.quantize_fp8_block_into(spec, w, codes, scale)
        assert amax.shape == (3, 3, 3)
        for e in range(3):
            q, a = triton_quant.quantize_fp8_block(spec, w[e])
            label = f"{dtype} expert {e}"
            assert torch.equal(_bits(codes[e]), _bits(q.codes)), label
            assert torch.equal(scale[e].contiguous().view(torch.int32),
                               q.scale.view(torch.int32)), label
            assert torch.equal(amax[e].view(torch.int32), a.view(torch.int32)), label
        bad = torch.stack([amax[0, 0, 0], amax[1, 1, 2], amax[2, 0, 0]])
        assert not torch.isfinite(bad).any() and torch.isfinite(amax).sum() == 27 - 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_direct_writer_takes_the_fused_write(fmt, launches):
    """The direct writer (``writer_for``: the engine-like model of test_sglang_direct.py, the
    trainer's stream with stacked experts) quantizes every weight through the fused write, and
    leaves the engine's bits of the torch write. Catches: the old code (fp8_block: no fused
    write named, no launch), a format whose ``fused_into_kernel`` names no kernel of
    :mod:`triton_quant` (an AttributeError), the writer bypassing ``quantize_into``."""
    from megatron_qrl.quant.pack_stream import writer_stream
    from megatron_qrl.rollout_sglang.sync.loader.live_storage import describe
    from megatron_qrl.rollout_sglang.sync.writer import writer_for
    from tests.rollout_sglang.test_sglang_direct import engine, hf_weights, state

    spec, out = get_spec(fmt), {}
    for impl in ("triton", "torch"):
        set_quant_impl(impl)
        m = engine(fmt, seed=1)
        writer = writer_for(spec, *describe(m))
        writer.write_all(writer_stream(spec, hf_weights(0), stack_experts=True))
        out[impl] = state(m)
        if impl == "triton":  # q/k/v/o per layer and the expert stacks
            assert writer.quantized > 0 and len(launches) == writer.quantized, \
                (len(launches), writer.quantized)
    assert [n for n in out["torch"] if not torch.equal(out["torch"][n], out["triton"][n])] == []
