"""The fused Triton write of fp8 / int8 codes and scales into an engine's regions
(``triton_quant.quantize_channel_into``, taken by ``QuantSpec.quantize_into`` where it runs)
gives the torch code's bits, run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set here before Triton loads): weights and expert stacks written into
strided regions (a fused parameter's member rows, one half of every expert's ``w13``), the
rest of the region's tensor untouched, and a non-finite weight refused naming it.

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


@pytest.fixture
def launches(monkeypatch):
    """Calls of the fused write (the tests compare it with the torch code: it must run)."""
    seen = []
    real = triton_quant.quantize_channel_into

    def spy(*args):
        seen.append(args[1].shape)
        return real(*args)

    monkeypatch.setattr(triton_quant, "quantize_channel_into", spy)
    yield seen
    set_quant_impl(None)


def _into(fmt, name, w, impl, start=128):
    set_quant_impl(impl)
    eng = Engine(start=start)
    written = dict(get_spec(fmt).quantize_into(name, w, eng.region))
    assert all(eng.untouched(k, t.shape) for k, t in written.items()), (fmt, impl)
    return {k: _bits(t) for k, t in written.items()}


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_fused_write_equals_the_torch_write(fmt, launches):
    """Catches: a scale or code stored at another stride than the region's (an expert's rows
    past the first expert, the scales' expert stride), an expert's amax taken over another
    expert's rows, codes that differ from the torch write (zero rows, the E4M3 saturation at
    448, int8 rounding ties)."""
    cases = [(STACK, _weights((3, 200, 256))), (STACK, _weights((2, 16, 40), seed=1)),
             (ONE, _weights((130, 256), seed=2))]
    cases += [(ONE, w) for _, w in weights(fmt)]
    for name, w in cases:
        got, want = _into(fmt, name, w, "triton"), _into(fmt, name, w, "torch", start=3)
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k], want[k]), (fmt, name, tuple(w.shape), k)
    assert len(launches) == len(cases)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_fused_write_refuses_a_non_finite_weight_naming_it(fmt, launches):
    w = _weights((2, 32, 64))
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
