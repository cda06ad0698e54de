"""UAQ (QuRL eq. 10-12) on tiny random transformers Qwen3 / Qwen3-MoE / Qwen2-MoE models."""

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.uaq import (
    AlreadyScaledError,
    apply_uaq,
    apply_uaq_to_model,
    check_not_already_scaled,
    default_uaq_scale,
    read_uaq_scale,
    uaq_metadata,
    uaq_plan,
)

S = 1.5
COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, dtype="float32",
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def _randomize(model):
    """Random norm gains and a sharp router so that a wrong scale cannot hide."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.eval()


def _dense():
    torch.manual_seed(0)
    cfg = Qwen3Config(intermediate_size=128, head_dim=16, **COMMON)
    return _randomize(Qwen3ForCausalLM(cfg))


def _moe():
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(intermediate_size=128, head_dim=16, **COMMON, **MOE)
    return _randomize(Qwen3MoeForCausalLM(cfg))


def _qwen2_moe_shared():
    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(intermediate_size=128, shared_expert_intermediate_size=48, **COMMON, **MOE)
    return _randomize(Qwen2MoeForCausalLM(cfg))


BUILDERS = {"dense": _dense, "moe": _moe, "qwen2_moe_shared": _qwen2_moe_shared}
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))


def _config(model):
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    return cfg


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_uaq_state_dict_keeps_logits(kind):
    model = BUILDERS[kind]()
    ref = _logits(model)
    sd = model.state_dict()
    scaled = apply_uaq(sd, _config(model), S)
    twin = copy.deepcopy(model)
    twin.load_state_dict(scaled)
    assert _max_diff(_logits(twin), ref) <= 1e-5
    # not vacuous: the weights did change, by exactly the closed form
    q = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(scaled[q], sd[q] / S, rtol=0, atol=0)
    n = "model.layers.1.post_attention_layernorm.weight"
    torch.testing.assert_close(scaled[n], sd[n] * S, rtol=0, atol=0)
    consumer = "mlp.gate_proj.weight" if kind == "dense" else "mlp.gate.weight"  # MLP or router
    k = f"model.layers.0.{consumer}"
    torch.testing.assert_close(scaled[k], sd[k] / S, rtol=0, atol=0)


def test_uaq_checkpoint_layout_per_expert(tmp_path):
    """The converter's path: per-expert safetensors + config.json -> scaled -> reloads."""
    model = _moe()
    ref = _logits(model)
    model.save_pretrained(tmp_path / "in")
    sd = load_file(tmp_path / "in" / "model.safetensors")
    config = json.loads((tmp_path / "in" / "config.json").read_text())
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in sd  # checkpoint layout
    scaled = apply_uaq(sd, config, S)
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            k = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
            want = sd[k] if proj == "down_proj" else sd[k] / S
            assert torch.equal(scaled[k], want), k
    out = tmp_path / "out"
    out.mkdir()
    save_file(scaled, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    reloaded = Qwen3MoeForCausalLM.from_pretrained(out).eval()
    assert _max_diff(_logits(reloaded), ref) <= 1e-5


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_apply_uaq_to_model_in_place(kind):
    model = BUILDERS[kind]()
    ref = _logits(model)
    before = model.model.layers[0].self_attn.k_proj.weight.detach().clone()
    assert apply_uaq_to_model(model, S) is model
    assert torch.equal(model.model.layers[0].self_attn.k_proj.weight, before / S)
    assert _max_diff(_logits(model), ref) <= 1e-5


def _router_outputs(model):
    seen = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o))
    logits = _logits(model)
    hook.remove()
    return logits, seen[0]


def test_unscaled_router_changes_routing():
    model = _moe()
    ref_logits, (_, ref_scores, ref_idx) = _router_outputs(model)
    good = copy.deepcopy(model)
    apply_uaq_to_model(good, S)
    logits, (_, scores, idx) = _router_outputs(good)
    assert torch.equal(idx, ref_idx) and _max_diff(scores, ref_scores) <= 1e-5
    bad = copy.deepcopy(good)
    with torch.no_grad():  # undo UAQ on the routers only
        for layer in bad.model.layers:
            layer.mlp.gate.weight.mul_(S)
    bad_logits, (_, bad_scores, bad_idx) = _router_outputs(bad)
    # router logits s*z: the same top-k experts, but sharper routing weights and new logits
    assert torch.equal(bad_idx, ref_idx)
    assert _max_diff(bad_scores, ref_scores) > 1e-2
    assert _max_diff(bad_logits, ref_logits) > 100 * _max_diff(logits, ref_logits)
    assert _max_diff(bad_logits, ref_logits) > 1e-4


def test_uaq_does_not_mutate_input():
    model = _moe()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    before = {k: v.clone() for k, v in sd.items()}
    out = apply_uaq(sd, _config(model), S)
    assert out is not sd and set(out) == set(sd)
    assert all(torch.equal(sd[k], before[k]) for k in sd)
    params = dict(model.named_parameters())  # trainable leaves: outputs stay out of autograd
    assert all(t.grad_fn is None for t in apply_uaq(params, _config(model), S).values())


def test_uaq_bf16_rounds_once_from_fp32():
    model = _dense()
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    out = apply_uaq(sd, _config(model), S)
    k = "model.layers.0.self_attn.v_proj.weight"
    assert out[k].dtype == torch.bfloat16
    assert torch.equal(out[k], (sd[k].float() / S).to(torch.bfloat16))


def test_sgd_gradient_grows_by_s():
    """QuRL eq. 12: dL/d(W/s) = s * dL/dW for every scaled linear (input grew by s)."""
    model = _moe()
    twin = copy.deepcopy(model)
    apply_uaq_to_model(twin, S)
    grads = []
    for m in (model, twin):
        m.zero_grad()
        m(IDS).logits.square().mean().backward()
        grads.append(dict(m.named_parameters()))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
                 "model.layers.1.mlp.gate.weight"):
        g0, g1 = grads[0][name].grad, grads[1][name].grad
        torch.testing.assert_close(g1, S * g0, rtol=1e-4, atol=1e-9)
    # the unscaled consumers see unchanged inputs: unchanged gradients
    o = "model.layers.0.self_attn.o_proj.weight"
    torch.testing.assert_close(grads[1][o].grad, grads[0][o].grad, rtol=1e-4, atol=1e-9)


def _int8_fake_quant(w):
    """The rollout's INT8 weights: symmetric per output channel, step = amax_row / 127."""
    return get_spec("int8").fake_quant_weight(w)


def test_int8_spec_is_the_per_channel_grid_these_tests_assume():
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    step = w.abs().amax(dim=1, keepdim=True) / 127.0
    torch.testing.assert_close(_int8_fake_quant(w), torch.round(w / step) * step, rtol=0, atol=1e-6)


@pytest.mark.parametrize("s", [1.0, 1.5, 2.0])
def test_update_survives_quantization_only_with_uaq(s):
    """A small update lost to INT8 rounding at s=1 survives at s>1 (QuRL eq. 10-12).

    W starts on the INT8 grid (the rollout copy equals it); the update is u * step with
    |u| < 0.44 uniform (zero on the row max), so at s=1 it vanishes exactly. After UAQ the
    grid step is step/s and the update is s*u*step (SGD) or u*step (Adam, scale-free): it
    survives when |u| > 1/(2 s^2) (SGD) or 1/(2 s) (Adam), closed-form fractions.
    """
    model = _dense()
    name = "model.layers.0.mlp.up_proj.weight"
    sd = dict(model.state_dict())
    sd[name] = _int8_fake_quant(sd[name])  # on the grid
    w = apply_uaq(sd, _config(model), s)[name]
    step = sd[name].abs().amax(dim=1, keepdim=True) / 127.0
    u = (torch.rand(w.shape, generator=torch.Generator().manual_seed(3)) * 2 - 1) * 0.44
    u[torch.round(sd[name] / step).abs() == 127] = 0.0
    q0 = _int8_fake_quant(w)
    torch.testing.assert_close(q0, w, rtol=1e-6, atol=0)  # W/s stays on its grid (+- 1 ulp)
    a = 0.44
    for update, bound in ((s * u * step, 1 / (2 * s * s)), (u * step, 1 / (2 * s))):  # SGD, Adam
        changed = (_int8_fake_quant(w + update) != q0).float().mean().item()
        expected = max(0.0, a - bound) / a * (u != 0).float().mean().item()
        assert abs(changed - expected) < 0.03, (s, changed, expected)
        if s == 1.0:
            assert changed == 0.0  # vanished
        else:
            assert changed > 0.1  # measurable


def test_update_survival_grows_like_s_squared_sgd_and_s_adam():
    """Off the grid (generic W): P(rounded value changes) = |update| / step.

    The update skips each row's max entry so the per-channel step stays put (a moved row
    max would re-grid the whole row and count as a change everywhere).
    """
    w = torch.randn(512, 512, generator=torch.Generator().manual_seed(4)) * 0.02
    step = w.abs().amax(dim=1, keepdim=True) / 127.0
    sign = torch.randint(0, 2, w.shape, generator=torch.Generator().manual_seed(5)) * 2 - 1
    sign[w.abs() == w.abs().amax(dim=1, keepdim=True)] = 0
    c = 0.05
    fractions = {}
    for s in (1.0, 1.5):
        ws = w / s
        q0 = _int8_fake_quant(ws)
        for opt, upd in (("sgd", s * c * step * sign), ("adam", c * step * sign)):
            fractions[opt, s] = (_int8_fake_quant(ws + upd) != q0).float().mean().item()
    assert fractions["sgd", 1.0] == pytest.approx(c, rel=0.1)
    assert fractions["sgd", 1.5] == pytest.approx(c * 1.5**2, rel=0.1)
    assert fractions["adam", 1.5] == pytest.approx(c * 1.5, rel=0.1)


@pytest.mark.parametrize("bad", [0, -1.5, math.nan, math.inf, True, "1.5", None])
def test_bad_scale_names_the_flag(bad):
    model = _dense()
    with pytest.raises(ValueError, match=r"--qrl-uaq-scale / --uaq-scale"):
        apply_uaq(model.state_dict(), _config(model), bad)
    with pytest.raises(ValueError, match=r"--qrl-uaq-scale"):
        apply_uaq_to_model(model, bad)


def test_missing_and_unknown_tensors_are_named():
    model = _moe()
    cfg = _config(model)
    sd = dict(model.state_dict())
    router = sd.pop("model.layers.1.mlp.gate.weight")
    with pytest.raises(ValueError, match=r"lacks tensor 'model\.layers\.1\.mlp\.gate\.weight'"):
        apply_uaq(sd, cfg, S)
    sd["model.layers.1.mlp.gate.weight"] = router
    sd["model.layers.2.input_layernorm.weight"] = torch.ones(64)
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.2\.input_layernorm"):
        apply_uaq(sd, cfg, S)
    with pytest.raises(ValueError, match=r"'architectures'.*not supported"):
        apply_uaq(model.state_dict(), {**cfg, "architectures": ["LlamaForCausalLM"]}, S)
    with pytest.raises(ValueError, match=r"lacks 'num_hidden_layers'"):
        uaq_plan(model.state_dict(), {k: v for k, v in cfg.items() if k != "num_hidden_layers"})


def test_tied_embeddings_make_lm_head_optional():
    model = _dense()
    sd = dict(model.state_dict())
    sd.pop("lm_head.weight")
    with pytest.raises(ValueError, match=r"lacks tensor 'lm_head\.weight'"):
        apply_uaq(sd, _config(model), S)
    assert "lm_head.weight" not in apply_uaq(sd, {**_config(model), "tie_word_embeddings": True}, S)


def test_metadata_rejects_a_second_uaq():
    meta = uaq_metadata(S)
    assert meta == {"uaq_scale": 1.5}
    check_not_already_scaled(None)
    check_not_already_scaled({})
    check_not_already_scaled({"uaq_scale": "1.0"})
    for recorded in (meta, {k: str(v) for k, v in meta.items()}):  # JSON or safetensors str
        assert read_uaq_scale(recorded) == 1.5
        with pytest.raises(AlreadyScaledError, match=r"my/ckpt is already UAQ-scaled"):
            check_not_already_scaled(recorded, source="my/ckpt")
    with pytest.raises(ValueError, match="must be a number"):
        read_uaq_scale({"uaq_scale": "x"})
    with pytest.raises(ValueError, match="--uaq-scale"):
        uaq_metadata(0.0)


def test_default_scale_follows_the_learning_rate():
    assert default_uaq_scale(1e-6) == 1.5
    assert default_uaq_scale(1e-5) == 1.0
    with pytest.raises(ValueError, match="learning rate"):
        default_uaq_scale(0.0)


def test_converter_metadata_with_null_scale_counts_as_unscaled():
    from megatron_qrl.quant.uaq import check_not_already_scaled, read_uaq_scale

    assert read_uaq_scale({"uaq_scale": None}) == 1.0
    check_not_already_scaled({"uaq_scale": None, "architecture": "Qwen3MoeForCausalLM"})
