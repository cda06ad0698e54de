"""quant.pack_stream: the batched pack stream equals the one-at-a-time stream, bit for bit."""

from __future__ import annotations

import pickle

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.pack_stream import layer_prefix, pack_stream, tensor_kind
from megatron_qrl.utils.finite import NonFiniteError

FORMATS = ["bf16", "int8", "fp8", "fp8_block", "w4a16", "nvfp4"]


def moe_stream(layers=2, experts=8, hidden=256, inter=128, heads=4, kv_heads=2, head_dim=64,
               expert_order="hf", dtype=torch.bfloat16, with_down=True, seed=0):
    """A Qwen3-MoE-shaped HF stream; ``expert_order="megatron"`` sends every expert's gate/up
    first, then every down (grouped-GEMM parameter order). ``with_down=False`` leaves the
    experts' down_proj out (fp8_block takes no 64-wide input, the 64-row gate/up it does)."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=0.02):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    out = [("model.embed_tokens.weight", t(64, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", t(hidden, scale=1.0)),
                (p + "self_attn.q_proj.weight", t(heads * head_dim, hidden)),
                (p + "self_attn.k_proj.weight", t(kv_heads * head_dim, hidden)),
                (p + "self_attn.v_proj.weight", t(kv_heads * head_dim, hidden)),
                (p + "self_attn.o_proj.weight", t(hidden, heads * head_dim)),
                (p + "self_attn.q_norm.weight", t(head_dim, scale=1.0)),
                (p + "self_attn.k_norm.weight", t(head_dim, scale=1.0)),
                (p + "post_attention_layernorm.weight", t(hidden, scale=1.0)),
                (p + "mlp.gate.weight", t(experts, hidden))]
        gate_up = [[(f"{p}mlp.experts.{j}.{k}_proj.weight", t(inter, hidden) * (j + 1))
                    for k in ("gate", "up")] for j in range(experts)]
        down = [[(f"{p}mlp.experts.{j}.down_proj.weight", t(hidden, inter))] if with_down else []
                for j in range(experts)]
        if expert_order == "hf":
            out += [x for j in range(experts) for x in (*gate_up[j], *down[j])]
        else:
            out += [x for pair in gate_up for x in pair] + [x for d in down for x in d]
    out[-1][1][5].zero_()  # an all-zero row must not leak into its stack neighbours
    out += [("model.norm.weight", t(hidden, scale=1.0)), ("lm_head.weight", t(64, hidden))]
    return out


def reference(spec, stream):
    """The pre-batching implementation, written out: ``pack`` per tensor, fused groups of a
    per-tensor-scale format held back and packed together with their shared amax (the max of
    the members' amaxes) once complete."""
    out, pending = [], {}
    for name, w in stream:
        group = spec.fusion_group(name)
        if group is None:
            out += spec.pack(name, w)
            continue
        key, members = group
        got = pending.setdefault(key, {})
        got[name] = w
        if len(got) == len(members):
            del pending[key]
            shared = max(float(got[m].float().abs().amax()) for m in members)
            for m in members:
                out += spec.pack(m, got[m], global_amax=shared)
    assert not pending
    return out


def _bits(t):
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def assert_same_stream(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(_bits(a), _bits(b)), name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", [
    {},                                   # stacks everywhere (fp8_block: 128-row aligned)
    {"expert_order": "megatron"},
    {"inter": 64, "with_down": False},    # fp8_block: 64-row gate/up cannot stack
    {"dtype": torch.float32, "experts": 3},
])
@pytest.mark.parametrize("window_bytes", [1 << 30, 40_000])
def test_stream_equals_one_at_a_time(fmt, case, window_bytes):
    spec = get_spec(fmt)
    stream = moe_stream(**case)
    want = reference(spec, stream)
    assert_same_stream(list(spec.pack_state_dict(stream, stacked=False)), want)
    got = list(pack_stream(spec, iter(stream), window_bytes=window_bytes, stack_cpu=True))
    assert_same_stream(got, want)
    for (name, t), (_, ref) in zip(got, want):  # no view into a stack (pickled whole)
        assert t.untyped_storage().nbytes() <= ref.untyped_storage().nbytes(), name


def _count_quantize_calls(monkeypatch, spec):
    calls = []
    original = type(spec).quantize_weight

    def counting(self, w, **kw):
        calls.append(kw.get("name"))
        return original(self, w, **kw)

    monkeypatch.setattr(type(spec), "quantize_weight", counting)
    return calls


@pytest.mark.parametrize("fmt,inter,expected", [
    # per layer: q, k, v, o stack apart (different kinds); gate, up, down one stack each
    ("int8", 128, 2 * 7), ("fp8_block", 128, 2 * 7), ("int8", 64, 2 * 6),
    # fp8_block with 64-row gate/up (no down): those 16 per layer go one at a time
    ("fp8_block", 64, 2 * (4 + 16)),
    # nvfp4: gate and up each one stack, with each expert's gate/up shared amax per row
    ("nvfp4", 128, 2 * 7),
])
def test_stacking_happens(monkeypatch, fmt, inter, expected):
    spec = get_spec(fmt)
    calls = _count_quantize_calls(monkeypatch, spec)
    stream = moe_stream(inter=inter, with_down=inter == 128)
    list(pack_stream(spec, stream, stack_cpu=True))
    assert len(calls) == expected
    if fmt in ("int8", "nvfp4"):
        assert "model.layers.1.mlp.experts.*.gate_proj.weight[0..7] (stacked)" in calls
    calls.clear()  # a CPU stream goes one at a time by default (no launches to save there)
    list(spec.pack_state_dict(stream))
    assert len(calls) == sum(spec.is_quantized(n) for n, _ in stream)


def _shuffle_fused(stream):
    """Send every fused group's members out of order (up before gate, v, k, q), and expert 0's
    gate/up of each layer after all its other experts."""
    out, late = [], []
    order = {"gate_proj": 1, "up_proj": 0, "q_proj": 2, "k_proj": 1, "v_proj": 0}
    i = 0
    while i < len(stream):
        name = stream[i][0]
        kind = name.split(".")[-2]
        n = 3 if kind == "q_proj" else 2 if kind == "gate_proj" else 1
        run = sorted(stream[i:i + n], key=lambda p: order.get(p[0].split(".")[-2], 0))
        (late if ".experts.0." in name and n == 2 else out).extend(run)
        if late and ".experts.7.down_proj" in name:
            out, late = out + late, []
        i += n
    return out


@pytest.mark.parametrize("window_bytes", [1 << 30, 40_000, 1])
def test_nvfp4_fused_groups_out_of_order(window_bytes):
    """Members arriving out of order or late: same order, names and bits as the reference;
    small windows never split a group (each member sees its group's shared amax)."""
    spec = get_spec("nvfp4")
    stream = _shuffle_fused(moe_stream())
    assert stream.index(next(p for p in stream if p[0].endswith("experts.0.up_proj.weight"))) \
        > stream.index(next(p for p in stream if p[0].endswith("experts.7.gate_proj.weight")))
    want = reference(spec, stream)
    assert [n for n, _ in want] != [n for n, _ in reference(spec, moe_stream())]
    assert_same_stream(list(pack_stream(spec, iter(stream), window_bytes=window_bytes,
                                        stack_cpu=True)), want)


def test_window_never_spans_layers():
    spec = get_spec("int8")
    stream = moe_stream()
    consumed = []

    def source():
        for i, pair in enumerate(stream):
            consumed.append(i)
            yield pair

    first_l1 = next(i for i, (n, _) in enumerate(stream) if n.startswith("model.layers.1."))
    for name, _ in pack_stream(spec, source(), stack_cpu=True):
        if name.startswith("model.layers.0."):  # layer 0 went out before layer 1 was read
            assert consumed[-1] <= first_l1


def test_window_bytes_bounds_the_buffer():
    spec = get_spec("fp8")
    stream = moe_stream()
    nbytes = [w.numel() * w.element_size() for _, w in stream]
    consumed = []

    def source():
        for i, pair in enumerate(stream):
            consumed.append(i)
            yield pair

    limit, sent, last = 100_000, 0, -1
    for _ in pack_stream(spec, source(), window_bytes=limit, stack_cpu=True):
        if consumed[-1] != last:  # a new window: it holds at most limit + one tensor
            held = sum(nbytes[sent:consumed[-1] + 1])
            assert held < limit + max(nbytes), held
            sent, last = consumed[-1] + 1, consumed[-1]


def test_nonfinite_names_the_exact_tensor():
    """The stacked stream names the weight, not its stack (tests/quant/test_pack_stream_finite.py:
    where and when, for every path)."""
    stream = moe_stream()
    bad = "model.layers.1.mlp.experts.5.up_proj.weight"
    dict(stream)[bad][2, 3] = float("nan")
    for fmt in ("int8", "fp8_block", "w4a16", "nvfp4"):
        with pytest.raises(NonFiniteError, match=rf"{fmt}: {bad} holds NaN / Inf"):
            list(pack_stream(get_spec(fmt), stream, stack_cpu=True))


def test_bad_shape_and_window_errors():
    stream = [("model.layers.0.mlp.experts.0.down_proj.weight", torch.zeros(128, 256)),
              ("model.layers.0.mlp.experts.1.down_proj.weight", torch.zeros(128))]
    with pytest.raises(ValueError, match="experts.1.down_proj.weight must be a 2-D"):
        list(pack_stream(get_spec("int8"), stream, stack_cpu=True))
    gate, up = (f"model.layers.0.mlp.experts.0.{k}_proj.weight" for k in ("gate", "up"))
    with pytest.raises(ValueError, match="nvfp4: .*experts.0.up_proj.weight must be a 2-D"):
        list(pack_stream(get_spec("nvfp4"), [(gate, torch.zeros(128, 256)),
                                             (up, torch.zeros(128))], stack_cpu=True))
    with pytest.raises(TypeError, match="nvfp4: .*experts.0.up_proj.weight has dtype torch.int8"):
        list(pack_stream(get_spec("nvfp4"), [(up, torch.zeros(128, 256, dtype=torch.int8)),
                                             (gate, torch.zeros(128, 256))], stack_cpu=True))
    with pytest.raises(ValueError, match="window_bytes must be a positive int"):
        pack_stream(get_spec("int8"), [], window_bytes=0)


def test_fused_groups_incomplete_still_raises():
    stream = [(n, w) for n, w in moe_stream() if "experts.3.up_proj" not in n]
    with pytest.raises(ValueError, match="fused groups incomplete.*experts.3"):
        list(get_spec("nvfp4").pack_state_dict(stream))
    sent = []  # the stacked stream sends all it can first, as the reference does
    with pytest.raises(ValueError, match="fused groups incomplete.*experts.3"):
        for name, _ in pack_stream(get_spec("nvfp4"), stream, window_bytes=40_000,
                                   stack_cpu=True):
            sent.append(name)
    want = [n for n, _ in reference(get_spec("nvfp4"),
                                    [p for p in stream if "experts.3.gate_proj" not in p[0]])]
    assert sent == want
    names = [n for n, _ in pack_stream(get_spec("int8"), stream, stack_cpu=True)]
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names


def test_outputs_pickle_alone():
    """An emitted tensor pickles to its own bytes, not to the whole stacked storage."""
    spec = get_spec("int8")
    got = dict(pack_stream(spec, moe_stream(), stack_cpu=True))
    w = got["model.layers.0.mlp.experts.0.gate_proj.weight"]
    assert len(pickle.dumps(w)) < 2 * w.numel() * w.element_size()


def test_name_helpers():
    assert layer_prefix("model.layers.12.mlp.gate.weight") == "model.layers.12."
    assert layer_prefix("model.embed_tokens.weight") is None
    assert layer_prefix("lm_head.weight") is None
    assert tensor_kind("model.layers.3.mlp.experts.17.gate_proj.weight") == \
        "model.layers.3.mlp.experts.*.gate_proj.weight"
    assert tensor_kind("model.layers.3.self_attn.q_proj.weight") == \
        "model.layers.3.self_attn.q_proj.weight"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the stacked default)")
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_default_stream_equals_one_at_a_time(fmt):
    """On the GPU the default pack_state_dict stacks; same stream as the reference there."""
    spec = get_spec(fmt)
    stream = [(n, w.cuda()) for n, w in moe_stream(experts=16, inter=256)]
    want = list(spec.pack_state_dict(stream, stacked=False))
    got = list(spec.pack_state_dict(stream))
    assert_same_stream(got, want)
    for (name, t), (_, ref) in zip(got, want):
        # w4a16's weight_shape and nvfp4's input_scale are host tensors in both streams
        assert t.device == ref.device, name
        assert t.untyped_storage().nbytes() <= ref.untyped_storage().nbytes(), name
