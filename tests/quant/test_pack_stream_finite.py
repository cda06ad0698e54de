"""A non-finite weight in a packed stream (quant.pack_stream, quant.finite_checks): one
NonFiniteError naming the first such weight in stream order, raised when the consumer asks for
the item after the last (so a transport never marks its last bucket), after ONE host sync for
the whole stream — counted on the CPU by OpCensus, the stream's tensors standing for device
tensors — instead of one per quantized weight."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.pack_stream import pack_stream
from megatron_qrl.utils.finite import NonFiniteError
from megatron_qrl.utils.op_census import OpCensus
from tests.quant.test_quant_pack_stream import moe_stream

FORMATS = ["int8", "fp8", "fp8_block", "w4a16", "nvfp4"]
FIRST = "model.layers.1.mlp.experts.5.up_proj.weight"
LATER = "model.layers.1.mlp.experts.6.gate_proj.weight"
"""Both non-finite in :func:`_broken`: FIRST comes first in the stream, but a window quantizes
every gate_proj of the layer before any up_proj."""


def _cache(spec, stream):
    """The aligned forward's Q(W) cache of some weights (o_proj, down_proj: no fused group)."""
    return {n: spec.quantize_weight(w, name=n) for n, w in stream
            if spec.is_quantized(n) and ("o_proj" in n or "down_proj" in n)}.get


MODES = {  # (spec, stream, cache) -> the packed stream
    "one at a time": lambda spec, s, _: spec.pack_state_dict(iter(s)),  # a CPU stream's default
    "stacked": lambda spec, s, _: pack_stream(spec, iter(s), stack_cpu=True),
    "stacked, small windows": lambda spec, s, _: pack_stream(spec, iter(s), window_bytes=40_000,
                                                             stack_cpu=True),
    "expert stacks": lambda spec, s, _: spec.pack_state_dict(iter(s), stack_experts=True),
    "Q(W) cache": lambda spec, s, cache: spec.pack_state_dict(iter(s), quantized=cache),
}


def _broken(stream, nan=(FIRST, LATER)):
    out = [(n, w.clone()) for n, w in stream]
    for name, w in out:
        if name == nan[0]:
            w[2, 3] = float("nan")
        elif name in nan[1:]:
            w[0, 0] = float("inf")
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_nonfinite_weight_fails_the_stream_at_its_end_naming_the_first(fmt, mode):
    """Fails on the old code (the error came at the bad weight, mid-stream; a window named
    the first bad weight of the first kind it quantized: LATER), and on ``_checked`` without
    ``order`` (LATER again) or a stack's rows not mapped to their weights."""
    spec, pack = get_spec(fmt), MODES[mode]
    stream = moe_stream()
    names = [n for n, _ in stream]
    assert names.index(FIRST) < names.index(LATER)
    cache = _cache(spec, stream)
    want = [n for n, _ in pack(spec, stream, cache)]
    got = []
    with pytest.raises(NonFiniteError, match=rf"^{fmt}: {re.escape(FIRST)} holds NaN / Inf"):
        for name, _ in pack(spec, _broken(stream), cache):
            got.append(name)
    assert got == want  # every tensor went out; the error took the place of the stream's end


@pytest.mark.parametrize("mode", ["one at a time", "stacked"])
def test_a_later_error_of_the_stream_comes_after_the_nonfinite_weight(mode):
    """A malformed tensor after a non-finite weight: the non-finite one is the error (as when
    each weight was checked at once). Fails with ``_checked``'s ``except`` branch removed."""
    stream = _broken(moe_stream(), nan=(FIRST,))
    stream.append(("model.layers.1.mlp.experts.7.down_proj.weight", torch.zeros(128)))
    with pytest.raises(NonFiniteError, match=re.escape(FIRST)) as err:
        list(MODES[mode](get_spec("int8"), stream, None))
    assert "must be a 2-D" in str(err.value.__context__)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["bf16", *FORMATS])
def test_a_packed_stream_reads_the_device_once(fmt, mode):
    """One host sync per stream (none for bf16: nothing quantized), where each quantized weight
    (or stack) cost one before: fails on the old code (int8 one at a time: 32 syncs; nvfp4's
    fused groups one more per member, their shared amax) and on a check per entry."""
    spec = get_spec(fmt)
    stream = moe_stream(experts=4)
    cache = _cache(spec, stream)  # the trainer's, made before the sync
    census = OpCensus()
    census.mark_device([w for _, w in stream])
    with torch.no_grad(), census.phase("pack"):
        n = sum(1 for _ in MODES[mode](spec, stream, cache))
    syncs = [f"{s.what} at {s.frame}" for s in census.syncs("pack")]
    assert n > len(stream) // 2
    assert len(syncs) == (1 if spec.quantizes_weights else 0), syncs
    assert all(s.startswith("_local_scalar_dense at megatron_qrl/quant/finite_checks.py:")
               for s in syncs), syncs


def test_finite_checks_name_the_weight_of_a_bad_row_of_a_stack():
    """Rows (or block rows: ``ok`` has one element per ``unit`` rows) map back to their weight;
    an empty check reads nothing."""
    from megatron_qrl.quant.finite_checks import FiniteChecks

    checks = FiniteChecks()
    checks.add("alone", torch.tensor(True))
    ok = torch.ones(6, dtype=torch.bool)  # block rows of 128: weights of 256, 128, 384 rows
    ok[4] = False
    checks.stack(["a", "b", "c"], [256, 128, 384]).add("label", ok)
    per_row = torch.ones(10, 3, dtype=torch.bool)  # [rows, blocks]: weights of 4 and 6 rows
    per_row[3, 1] = per_row[9, 0] = False
    checks.stack(["d", "e"], [4, 6]).add("label", per_row)
    assert checks.bad_weights() == ["c", "d", "e"]
    with pytest.raises(NonFiniteError, match=r"^int8: c holds NaN / Inf"):
        checks.check(get_spec("int8"))
    with pytest.raises(NonFiniteError, match=r"^int8: e holds"):
        checks.check(get_spec("int8"), order={"c": 2, "d": 1, "e": 0})
    FiniteChecks().check(get_spec("int8"))  # nothing added: nothing to read
