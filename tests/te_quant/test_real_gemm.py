"""The aligned forward's real low-bit GEMM (fp8 ``_scaled_mm``, int8 ``_int_mm``) on CPU.

torch runs both kernels on the CPU, so ``gemm="real"`` is forced here (``auto`` keeps the
fake path on a CPU). Tolerance of one GEMM, real vs fake (BF16 operands and output):
the fake path rounds each dequantized operand to BF16 (relative error <= 2^-9 each, so
<= 2^-8 + 2^-18 per product) and both paths round the output to BF16 (<= 2^-9 |y| each), so

    |y_real - y_fake| <= 2^-8 (1 + 2^-8) (|deq x| @ |deq W|^T) + 2^-8 |y_fake| + fp32 sums

checked elementwise with the fp32-accumulation slack ``K * 2^-24 (|x| @ |W|^T)``. A wrong
scale (per-tensor activation scale, weight scale on the wrong axis) moves elements by a
quantization step (>= 2^-4 relative), far outside it. In FP32 models the two paths differ
only by fp32 summation order, so whole-model logits agree to 1e-4 up to rounding-boundary
flips (``assert_close_up_to_flips``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.te_quant.real_gemm import (
    DeviceInfo,
    RealWeight,
    activation_operand,
    grouped_real_linear,
    kernel_for,
    real_linear,
    select_gemm,
    weight_operand,
)
from tests.helpers.te_quant_fixtures import (
    FLIP_BATCH,
    assert_close_up_to_flips,
    build,
    hf_state,
    ids,
    tiny_hf,
)

REAL = ("fp8", "int8")
CPU, H200, A100 = DeviceInfo("cpu"), DeviceInfo("cuda", (9, 0)), DeviceInfo("cuda", (8, 0))


@pytest.fixture
def no_engine_kernels(monkeypatch):
    """This process without SGLang (fp8_block's real GEMM is SGLang's; with it:
    tests/te_quant/test_block_gemm.py)."""
    from megatron_qrl.te_quant import real_gemm

    monkeypatch.setattr(real_gemm, "engine_kernels", lambda: (False, "not installed"))


@pytest.mark.parametrize("fmt,device,mode,want", [
    ("fp8", CPU, "auto", "fake"), ("int8", CPU, "auto", "fake"),
    ("fp8", H200, "auto", "real"), ("int8", H200, "auto", "real"),
    ("fp8", A100, "auto", "fake"), ("int8", A100, "auto", "real"),
    ("fp8_block", H200, "auto", "fake"), ("w4a16", H200, "auto", "fake"),
    ("nvfp4", H200, "auto", "fake"), ("bf16", H200, "auto", "fake"),
    ("fp8", H200, "fake", "fake"), ("fp8", CPU, "real", "real"), ("int8", CPU, "real", "real"),
])
def test_selection_table(no_engine_kernels, fmt, device, mode, want):
    assert select_gemm(get_spec(fmt), device, mode).gemm == want


@pytest.mark.parametrize("fmt,device", [("fp8_block", H200), ("w4a16", H200), ("nvfp4", H200),
                                        ("fp8", A100), ("bf16", CPU)])
def test_real_refused_where_no_kernel_names_the_flag(no_engine_kernels, fmt, device):
    with pytest.raises(ValueError, match="--qrl-train-aligned-gemm real"):
        select_gemm(get_spec(fmt), device, "real")


def test_flag_parsed_and_checked():
    from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.te_quant import trainer_forward
    from megatron_qrl.te_quant.forward import aligned_gemm

    assert TrainForwardConfig().aligned_gemm == "auto"
    configs = parse_configs(["--qrl-preset", "tiny-cpu", "--qrl-train-aligned-gemm", "real"])[0]
    assert configs["train"].aligned_gemm == "real"
    _, dense = tiny_hf("dense")
    fwd = trainer_forward(TrainForwardConfig("aligned", aligned_gemm="real"), "int8",
                          RoutingReplayConfig("off"), dense)
    assert fwd.aligned.gemm == "real"
    auto = trainer_forward(TrainForwardConfig("aligned"), "fp8", RoutingReplayConfig("off"), dense)
    if not torch.cuda.is_available():
        assert auto.aligned.gemm == "fake"  # the CPU keeps the fake path under auto
    with pytest.raises(ValueError, match="--qrl-train-aligned-gemm real: fp8_block"):
        trainer_forward(TrainForwardConfig("aligned", aligned_gemm="real"), "fp8_block",
                        RoutingReplayConfig("off"), dense)
    with pytest.raises(ValueError, match="--qrl-train-aligned-gemm"):
        TrainForwardConfig(aligned_gemm="fast")
    assert aligned_gemm("fp8", "auto", device=CPU) == "fake"
    assert aligned_gemm("int8", "real", device=CPU) == "real"
    with pytest.raises(ValueError, match="--qrl-train-aligned-gemm real: a Transformer Engine"):
        aligned_gemm("fp8", "real", te_recipe=True, device=H200)


def _operands(seed=0, m=24, k=96, n=40, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1).to(dtype)
    x[3] = 0  # an all-zero token (fp8: inverse scale 0)
    return x, w


@pytest.mark.parametrize("fmt", REAL)
def test_codes_and_scales_equal_the_spec(fmt):
    spec = get_spec(fmt)
    x, w = _operands()
    qw, q = weight_operand(spec, w), spec.quantize_weight(w)
    assert qw.codes.dtype == q.codes.dtype and torch.equal(qw.codes.view(torch.int8),
                                                           q.codes.view(torch.int8))
    assert torch.equal(qw.scale, q.scale) and qw.scale.shape == (w.shape[0], 1)
    assert torch.equal(qw.dequantize(spec, w.dtype), spec.quantize_dequantize(w))
    xq, xs = activation_operand(spec, x)
    assert xs.shape == (x.shape[0], 1) and xq.dtype == q.codes.dtype
    assert torch.equal((xq.float() * xs).to(x.dtype), spec.fake_quant_activation(x))


def _bound(x, w, spec, y_fake):
    xd = spec.fake_quant_activation(x).float().abs()
    wd = spec.quantize_dequantize(w).float().abs()
    a = xd @ wd.t()
    k = x.shape[-1]
    return 2.0 ** -8 * (1 + 2.0 ** -8) * a + 2.0 ** -8 * y_fake.float().abs() + k * 2.0 ** -24 * a


@pytest.mark.parametrize("fmt", REAL)
@pytest.mark.parametrize("shape", [(24, 96, 40), (40, 64, 40)])
def test_real_gemm_equals_fake_up_to_bf16_rounding(fmt, shape):
    spec = get_spec(fmt)
    m, k, n = shape
    x, w = _operands(m=m, k=k, n=n)
    fake = spec.fake_quant_activation(x) @ spec.quantize_dequantize(w).t()
    xq, xs = activation_operand(spec, x)
    qw = weight_operand(spec, w)
    real = kernel_for(spec)(xq, xs, qw.codes, qw.scale, torch.bfloat16)
    err = (real.float() - fake.float()).abs()
    bound = _bound(x, w, spec, fake)
    print(f"{fmt} {shape}: max |real - fake| {err.max():.3g}, max err/bound "
          f"{(err / bound.clamp_min(1e-30)).max():.3f}, exact {(err == 0).float().mean():.3f}")
    assert (err <= bound).all()


@pytest.mark.parametrize("fmt", REAL)
def test_cuda_shape_padding_is_exact(fmt):
    """The zero padding to the CUDA kernels' shapes (M > 16, K / N multiples of 8 or 16)
    leaves the result bit for bit unchanged (forced on the CPU)."""
    spec = get_spec(fmt)
    x, w = _operands(m=10, k=70, n=38)
    xq, xs = activation_operand(spec, x)
    qw = weight_operand(spec, w)
    fn = kernel_for(spec)
    plain = fn(xq, xs, qw.codes, qw.scale, torch.bfloat16, cuda_shapes=False)
    padded = fn(xq, xs, qw.codes, qw.scale, torch.bfloat16, cuda_shapes=True)
    assert padded.shape == (10, 38) and torch.equal(padded, plain)


@pytest.mark.parametrize("fmt", REAL)
def test_real_linear_gradients_equal_the_fake_path(fmt):
    """Same forward operands: dx and dW bit-equal the fake path's STE gradients."""
    spec = get_spec(fmt)
    x, w = _operands(seed=1)
    g = torch.randn(x.shape[0], w.shape[0]).to(x.dtype)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    real_linear(xr, wr, weight_operand(spec, w), spec).backward(g)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    (spec.fake_quant_activation(xf) @ spec.fake_quant_weight(wf).t()).backward(g)
    assert torch.equal(xr.grad, xf.grad) and torch.equal(wr.grad, wf.grad)


@pytest.mark.parametrize("per_expert", [False, True], ids=["stacked", "per-expert-masters"])
@pytest.mark.parametrize("fmt", REAL)
def test_grouped_real_equals_per_expert_fake(fmt, per_expert):
    """Stacked experts (one ``[E, N, K]`` master) and TE's grouped linear (one master per
    expert): outputs within the bound per expert, gradients bit-equal to the fake path's."""
    spec = get_spec(fmt)
    counts = [5, 0, 11, 8]
    x, _ = _operands(seed=2, m=sum(counts), k=64)
    ws = [_operands(seed=10 + e, k=64, n=32)[1] for e in range(len(counts))]
    stacked = torch.stack(ws).requires_grad_()
    qws = [weight_operand(spec, w) for w in ws]
    qw = RealWeight(torch.stack([q.codes for q in qws]), torch.stack([q.scale for q in qws]))
    xr = x.clone().requires_grad_()
    masters = [w.clone().requires_grad_() for w in ws] if per_expert else [stacked]
    real = grouped_real_linear(xr, masters, qw, spec, counts)
    xf = x.clone().requires_grad_()
    wf = torch.stack(ws).requires_grad_()
    from megatron_qrl.models.grouped_gemm import grouped_mm

    fake = grouped_mm(spec.fake_quant_activation(xf),
                      torch.stack([spec.fake_quant_weight(w) for w in wf.unbind(0)]), counts)
    starts = [sum(counts[:e]) for e in range(len(counts))]
    for e, c in enumerate(counts):
        rows = slice(starts[e], starts[e] + c)
        err = (real[rows].float() - fake[rows].float()).abs()
        assert (err <= _bound(x[rows], ws[e], spec, fake[rows])).all(), e
    g = torch.randn_like(fake)
    real.backward(g)
    fake.backward(g)
    got = torch.stack([m.grad for m in masters]) if per_expert else stacked.grad
    assert torch.equal(xr.grad, xf.grad) and torch.equal(got, wf.grad)


def _logits(model, x):
    from megatron_qrl.te_quant.attribution import megatron_logits

    return megatron_logits(model, x)


def _fake_then_real(state, model, label):
    """Logits on the flip batch through the fake GEMM, then the real GEMM (cache refreshed);
    asserts they agree to 1e-4 up to rounding-boundary flips. Returns ``(x, fake, real)``."""
    x = ids(**FLIP_BATCH)
    fake = _logits(model, x)
    state.gemm = "real"
    state.mark_weights_updated()
    real = _logits(model, x)
    assert_close_up_to_flips(real, fake, label, 1e-4)
    return x, fake, real


def _model(kind, fmt):
    from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks
    from tests.helpers.te_spec_cpu import build_te_shaped

    hf, arch = tiny_hf(kind.removeprefix("te-"))
    state = AlignedForwardState(fmt)
    if kind.startswith("te-"):  # TE spec names (TEGroupedMLP with --moe-grouped-gemm)
        model = build_te_shaped(arch, aligned_spec_hook(state), moe_grouped_gemm=arch.is_moe)
        load_hf_weights(model, arch, hf_state(hf).__getitem__, groups_from_parallel_state())
        return state, model
    hook = compose_hooks(stacked_experts_spec_hook if kind == "moe" else None,
                         aligned_spec_hook(state))
    return state, build(arch, hf_state(hf), hook)


@pytest.mark.parametrize("kind", ["dense", "moe", "te-dense", "te-moe"])
@pytest.mark.parametrize("fmt", REAL)
def test_model_real_equals_fake(megatron, kind, fmt):
    """FP32 tiny model (local spec, MoE: stacked experts; TE spec, MoE: TEGroupedMLP): real ==
    fake logits to 1e-4 up to rounding-boundary flips; the cache holds codes, once per step."""
    state, model = _model(kind, fmt)
    x, fake, real = _fake_then_real(state, model, f"{kind} {fmt} real vs fake")
    with state.only(()):
        plain = _logits(model, x)
    assert (plain - fake).abs().max() > 1e-2  # the check can fail: quantization shows
    caches = [m._qrl_cache for m in model.modules() if getattr(m, "_qrl_cache", None)]
    assert caches and all(isinstance(c[1], RealWeight) for c in caches)
    counts = [m.qrl_recomputes for m in model.modules() if hasattr(m, "qrl_recomputes")]
    _logits(model, x)
    assert counts == [m.qrl_recomputes for m in model.modules() if hasattr(m, "qrl_recomputes")]


def test_state_refuses_real_for_a_format_without_kernel():
    from megatron_qrl.te_quant import AlignedForwardState

    with pytest.raises(ValueError, match="--qrl-train-aligned-gemm real: fp8_block"):
        AlignedForwardState("fp8_block", gemm="real")


def _tp_linears(model):
    layer = model.decoder.layers[0]
    return {"qkv": layer.self_attention.linear_qkv, "proj": layer.self_attention.linear_proj,
            "fc1": layer.mlp.linear_fc1, "fc2": layer.mlp.linear_fc2}


def _tp_worker(rank, world_size, port, tensors, fmt):
    """Each linear of layer 0 at TP=2 (sequence parallel): output, input and weight gradients
    of the real path and the fake path for the same input and output gradient."""
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook
    from tests.helpers.te_quant_fixtures import quiet_torch_trace, tiny_cfg

    init_cpu_distributed(rank, world_size, port, tp=world_size)
    try:
        with quiet_torch_trace(), cpu_device_mode():
            arch = arch_from_dict(tiny_cfg("dense", num_attention_heads=4, num_key_value_heads=2))
            state = AlignedForwardState(fmt)
            model = build(arch, tensors, aligned_spec_hook(state),
                          layout=ParallelLayout(tp=world_size))
            assert model.config.sequence_parallel
            out = {}
            for name, lin in _tp_linears(model).items():
                g = torch.Generator().manual_seed(100 + rank)
                row = name in ("proj", "fc2")  # input split over TP; else sequence-split rows
                x = torch.randn(8 if row else 4, 2, lin.input_size_per_partition if row
                                else lin.input_size, generator=g) * 3
                res = {}
                for gemm in ("fake", "real"):
                    state.gemm = gemm
                    state.mark_weights_updated()
                    lin.zero_grad()
                    xi = x.clone().requires_grad_()
                    y = lin(xi)[0]
                    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)))
                    res[gemm] = (y.detach(), xi.grad, lin.weight.grad.clone())
                out[name] = res
            return out
    finally:
        destroy_cpu_distributed()


@pytest.mark.parametrize("fmt", REAL)
def test_tp2_sequence_parallel_real_equals_fake(fmt):
    """TP=2 with sequence parallelism, each kind of linear (column with the sequence-parallel
    gather, row with input features split): row-parallel weight and token scales span both
    ranks (gathered), the gather and the dgrad reduction are megatron's. FP32: output and
    gradients equal the fake path's to fp32 summation order (1e-5 of the largest); a local
    token / weight scale or a missing reduction moves them by a quantization step or more."""
    from tests.helpers.mp_utils import run_distributed

    hf, _ = tiny_hf("dense", num_attention_heads=4, num_key_value_heads=2)
    for out in run_distributed(_tp_worker, 2, hf_state(hf), fmt):
        for name, res in out.items():
            for what, real, fake in zip(("y", "dx", "dW"), res["real"], res["fake"]):
                torch.testing.assert_close(real, fake, rtol=1e-5,
                                           atol=1e-5 * fake.abs().max().item(),
                                           msg=lambda m, n=name, w=what: f"{fmt} {n} {w}: {m}")
