"""AQN (QeRL): schedule in closed form, and noise on the rollout stream's norm gains only."""

import itertools
import math

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_qrl.quant.aqn import (
    DEFAULT_AQN_TARGETS,
    AQNConfig,
    apply_aqn,
    aqn_sigma,
    aqn_stage,
    is_aqn_target,
)

S0, S1 = 1e-2, 5e-4


def _closed_form(k, K=10):
    return 0.0 if k == 0 else S0 * (S1 / S0) ** ((k - 1) / (K - 2))


def test_schedule_at_stage_boundaries():
    T, K = 1000, 10
    for k in range(K):
        first, last = 100 * k, 100 * k + 99
        assert aqn_stage(first, T, K) == k and aqn_stage(last, T, K) == k
        assert aqn_sigma(first, T) == pytest.approx(_closed_form(k), rel=1e-12)
        assert aqn_sigma(last, T) == aqn_sigma(first, T)
    assert aqn_sigma(99, T) == 0.0
    assert aqn_sigma(100, T) == pytest.approx(1e-2, rel=1e-12)
    assert aqn_sigma(500, T) == pytest.approx(1e-2 * math.sqrt(0.05), rel=1e-12)  # stage 5
    assert aqn_sigma(999, T) == pytest.approx(5e-4, rel=1e-12)
    sigmas = [aqn_sigma(100 * k, T) for k in range(1, K)]
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))  # geometric decay


def test_stage_of_uneven_runs():
    # stage = floor(step * K / T): with T=25, K=10 stage k starts at ceil(2.5 k)
    starts = [next(s for s in range(25) if aqn_stage(s, 25, 10) == k) for k in range(10)]
    assert starts == [math.ceil(2.5 * k) for k in range(10)]
    assert aqn_stage(24, 25, 10) == 9
    # fewer steps than stages: some stages are skipped, the last step is still the last stage
    assert [aqn_stage(s, 3, 10) for s in range(3)] == [0, 3, 6]
    # K=2: half the run noise-free, then sigma_start
    assert [aqn_sigma(s, 4, num_stages=2) for s in range(4)] == [0.0, 0.0, S0, S0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(step=-1, total_steps=10), "step must be an integer >= 0"),
        (dict(step=10, total_steps=10), "past the run"),
        (dict(step=0, total_steps=0), "total_steps"),
        (dict(step=0, total_steps=10, num_stages=1), "num_stages"),
        (dict(step=0, total_steps=10, sigma_start=0.0), "sigma_start"),
        (dict(step=0, total_steps=10, sigma_end=math.nan), "sigma_end"),
        (dict(step=1.5, total_steps=10), "step"),
        (dict(step=True, total_steps=10), "step"),
    ],
)
def test_schedule_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        aqn_sigma(**kwargs)


@pytest.fixture(scope="module")
def named():
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, dtype="float32",
    )
    model = Qwen3MoeForCausalLM(cfg)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_noise_touches_only_the_norm_gains_feeding_linears(named):
    before = {n: t.clone() for n, t in named}
    out = list(apply_aqn(named, 1e-2, _gen(0)))
    assert [n for n, _ in out] == [n for n, _ in named]  # order and names preserved
    noised = set()
    for (name, src), (_, dst) in zip(named, out):
        assert torch.equal(src, before[name])  # the trainer's tensor is untouched
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            assert dst is not src and not torch.equal(dst, src)
            assert (dst - src).abs().max() < 6e-2  # N(0, 1e-4): 6 sigma
            noised.add(name)
        else:
            assert dst is src, name  # q_norm, k_norm, final norm, linears: passed through
    assert len(noised) == 4  # 2 layers x 2 norms
    deltas = [d - s for (n, s), (_, d) in zip(named, out) if n in noised]
    assert not torch.equal(deltas[0], deltas[1])  # one draw per norm, not a shared one


def test_sigma_zero_is_bit_identical_and_draws_nothing(named):
    gen = _gen(0)
    state = gen.get_state()
    out = list(apply_aqn(named, 0.0, gen))
    assert all(d is s for (_, s), (_, d) in zip(named, out))
    assert torch.equal(gen.get_state(), state)


def test_same_seed_same_noise_other_seed_other_noise(named):
    a = dict(apply_aqn(named, 1e-2, _gen(7)))
    b = dict(apply_aqn(named, 1e-2, _gen(7)))
    c = dict(apply_aqn(named, 1e-2, _gen(8)))
    n = "model.layers.1.post_attention_layernorm.weight"
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[n], c[n])
    g1, g2 = AQNConfig.generator(3, 120), AQNConfig.generator(3, 120)
    assert torch.equal(torch.randn(8, generator=g1), torch.randn(8, generator=g2))
    other = AQNConfig.generator(3, 121)
    assert not torch.equal(other.get_state(), AQNConfig.generator(3, 120).get_state())


def test_parameters_in_the_stream_stay_out_of_autograd():
    p = torch.nn.Parameter(torch.ones(8))
    (_, out), = apply_aqn([("m.post_attention_layernorm.weight", p)], 1e-2, _gen(0))
    assert out.grad_fn is None and not out.requires_grad


def test_noise_std_matches_sigma():
    w = torch.ones(1_000_000)
    (_, out), = apply_aqn([("model.layers.0.input_layernorm.weight", w)], 3e-3, _gen(1))
    z = out - w
    assert z.std().item() == pytest.approx(3e-3, rel=0.01)
    assert abs(z.mean().item()) < 3e-3 * 5 / 1000  # 5 standard errors
    assert torch.equal(w, torch.ones(1_000_000))


def test_noise_is_drawn_in_fp32_then_cast():
    w = (1 + 0.1 * torch.randn(256, generator=_gen(2))).to(torch.bfloat16)
    (_, out), = apply_aqn([("a.input_layernorm.weight", w)], 1e-2, _gen(5))
    z = torch.randn(256, generator=_gen(5), dtype=torch.float32)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (w.float() + 1e-2 * z).to(torch.bfloat16))


def test_stream_is_lazy_and_targets_are_a_parameter():
    def endless():
        for i in itertools.count():
            yield f"model.layers.{i}.self_attn.q_norm.weight", torch.ones(4)

    out = list(itertools.islice(apply_aqn(endless(), 1e-2, _gen(0)), 3))
    assert all(torch.equal(t, torch.ones(4)) for _, t in out)  # q_norm: not a default target
    out = list(itertools.islice(apply_aqn(endless(), 1e-2, _gen(0), targets=("q_norm.weight",)), 3))
    assert all(not torch.equal(t, torch.ones(4)) for _, t in out)
    assert is_aqn_target("model.layers.3.input_layernorm.weight")
    assert not is_aqn_target("model.layers.3.xinput_layernorm.weight")
    assert not is_aqn_target("model.norm.weight", DEFAULT_AQN_TARGETS)


def test_apply_aqn_checks_arguments_eagerly():
    with pytest.raises(ValueError, match="sigma must be a finite number >= 0"):
        apply_aqn(iter(()), -1e-3, _gen(0))
    with pytest.raises(TypeError, match="torch.Generator"):
        apply_aqn(iter(()), 1e-3, 0)
    with pytest.raises(ValueError, match="targets is empty"):
        apply_aqn(iter(()), 1e-3, _gen(0), targets=())
    with pytest.raises(ValueError, match="expected floating"):
        list(apply_aqn([("x.input_layernorm.weight", torch.ones(3, dtype=torch.int32))], 1e-3, _gen(0)))


def test_config_validates_and_schedules():
    cfg = AQNConfig()
    assert (cfg.enabled, cfg.sigma_start, cfg.sigma_end, cfg.num_stages) == (False, 1e-2, 5e-4, 10)
    assert cfg.sigma(500, 1000) == 0.0  # disabled
    on = AQNConfig(enabled=True)
    assert on.sigma(500, 1000) == aqn_sigma(500, 1000)
    for bad, match in (
        (dict(sigma_start=-1.0), "--qrl-aqn-sigma-start"),
        (dict(sigma_end=math.inf), "--qrl-aqn-sigma-end"),
        (dict(num_stages=1), "--qrl-aqn-num-stages"),
        (dict(enabled="yes"), "enabled"),
    ):
        with pytest.raises(ValueError, match=match):
            AQNConfig(**bad)
