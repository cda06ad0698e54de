"""megatron_qrl inside slime: the weight-sync quantizer (through slime 0.3.1's own
``convert_to_hf`` + Qwen3-MoE converter), AQN on the rollout copy, the init hook, and the
aligned forward built through ``--spec`` and driven by the hooks. slime is found as in
test_integrations_slime.py; without it these tests skip with the reason."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tests.integrations.test_integrations_slime import SKIP, slime_args

pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

H, HD, HEADS, KV, EXPERTS, INTER, VOCAB = 256, 64, 4, 2, 4, 128, 64


@pytest.fixture
def clean_shim():
    from megatron_qrl.integrations.slime.quantizer import uninstall_quantizer

    uninstall_quantizer()
    yield
    uninstall_quantizer()


def hf_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A tiny Qwen3-MoE checkpoint (one layer), HF names, in checkpoint order."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (0.05 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    def gain(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

    p = "model.layers.0."
    out = [("model.embed_tokens.weight", w(VOCAB, H)), (p + "input_layernorm.weight", gain(H)),
           (p + "self_attn.q_proj.weight", w(HEADS * HD, H)), (p + "self_attn.k_proj.weight", w(KV * HD, H)),
           (p + "self_attn.v_proj.weight", w(KV * HD, H)), (p + "self_attn.q_norm.weight", gain(HD)),
           (p + "self_attn.k_norm.weight", gain(HD)), (p + "self_attn.o_proj.weight", w(H, HEADS * HD)),
           (p + "post_attention_layernorm.weight", gain(H)), (p + "mlp.gate.weight", w(EXPERTS, H))]
    for e in range(EXPERTS):
        out += [(f"{p}mlp.experts.{e}.{k}_proj.weight", w(*s)) for k, s in
                (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER)))]
    return out + [("model.norm.weight", gain(H)), ("lm_head.weight", w(VOCAB, H))]


def megatron_params(hf: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The same weights as slime's Megatron model names them (TE spec, grouped experts)."""
    p, m = "model.layers.0.", "module.module.decoder.layers.0."
    q = hf[p + "self_attn.q_proj.weight"].view(KV, -1, H)
    k, v = (hf[p + f"self_attn.{x}_proj.weight"].view(KV, HD, H) for x in "kv")
    out = [("module.module.embedding.word_embeddings.weight", hf["model.embed_tokens.weight"]),
           (m + "self_attention.linear_qkv.layer_norm_weight", hf[p + "input_layernorm.weight"]),
           (m + "self_attention.linear_qkv.weight", torch.cat([q, k, v], 1).reshape(-1, H)),
           (m + "self_attention.q_layernorm.weight", hf[p + "self_attn.q_norm.weight"]),
           (m + "self_attention.k_layernorm.weight", hf[p + "self_attn.k_norm.weight"]),
           (m + "self_attention.linear_proj.weight", hf[p + "self_attn.o_proj.weight"]),
           (m + "pre_mlp_layernorm.weight", hf[p + "post_attention_layernorm.weight"]),
           (m + "mlp.router.weight", hf[p + "mlp.gate.weight"])]
    for e in range(EXPERTS):
        x = f"{p}mlp.experts.{e}."
        out += [(f"{m}mlp.experts.linear_fc1.weight{e}",
                 torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])),
                (f"{m}mlp.experts.linear_fc2.weight{e}", hf[x + "down_proj.weight"])]
    return out + [("module.module.decoder.final_layernorm.weight", hf["model.norm.weight"]),
                  ("module.module.output_layer.weight", hf["lm_head.weight"])]


CONVERT_ARGS = argparse.Namespace(vocab_size=VOCAB, kv_channels=HD, hidden_size=H,
                                  num_attention_heads=HEADS, num_query_groups=KV, q_lora_rank=None)


def slime_sync(qcfg) -> dict[str, torch.Tensor]:
    """What slime's weight sync sends: convert_to_hf of every Megatron parameter."""
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf

    out: dict[str, torch.Tensor] = {}
    for name, param in megatron_params(dict(hf_tensors())):
        for hf_name, t in convert_to_hf(CONVERT_ARGS, "qwen3moe", name, param, qcfg):
            assert hf_name not in out, hf_name
            out[hf_name] = t
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_slime_sync_packs_exactly_like_quantspec(clean_shim):
    from megatron_qrl.integrations.slime.quantizer import install_quantizer
    from megatron_qrl.quant import get_spec, list_specs

    for fmt in list_specs():
        spec = get_spec(fmt)
        install_quantizer(fmt)
        want = dict(spec.pack_state_dict(hf_tensors()))
        got = slime_sync(spec.hf_quantization_config())
        assert_same(got, want)
        if spec.quantizes_weights:  # the packs really are quantized (not BF16 pass-through)
            assert any(t.dtype != torch.bfloat16 for t in got.values()), fmt


def test_unregistered_format_and_wrong_checkpoint_are_clear_errors(clean_shim):
    from megatron_qrl.integrations.slime.quantizer import install_quantizer, installed_quantizer
    from megatron_qrl.quant import get_spec

    with pytest.raises(ValueError, match="unknown quantization format 'fp6'.*int8"):
        install_quantizer("fp6")
    assert installed_quantizer() is None
    install_quantizer("int8")
    with pytest.raises(ValueError, match="int8.*no quantization_config.*export_quantized"):
        slime_sync(None)
    with pytest.raises(ValueError, match="int8.*differs in.*quant_method"):
        slime_sync(get_spec("fp8_block").hf_quantization_config())


def test_slime_signature_guard(clean_shim, monkeypatch):
    import slime.backends.megatron_utils.megatron_to_hf as m2h

    from megatron_qrl.integrations.slime.quantizer import install_quantizer

    monkeypatch.setattr(m2h, "quantize_params", lambda args, name, params, cfg: params)
    with pytest.raises(RuntimeError, match="slime 0.3.1 only"):
        install_quantizer("int8")


def test_aqn_noise_on_the_rollout_copy_only(clean_shim):
    from megatron_qrl.integrations.slime.quantizer import install_quantizer
    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.aqn import AQNConfig, is_aqn_target

    aqn = AQNConfig(enabled=True, sigma_start=0.05, sigma_end=0.01, num_stages=4)
    quantizer = install_quantizer("int8", aqn, seed=7, total_steps=8)
    spec = get_spec("int8")
    before = {n: t.clone() for n, t in hf_tensors()}
    clean = dict(spec.pack_state_dict(hf_tensors()))
    assert_same(slime_sync(spec.hf_quantization_config()), clean)  # step 0: stage 0, no noise
    quantizer.step = 3
    noisy = slime_sync(spec.hf_quantization_config())
    sigma = aqn.sigma(3, 8)
    assert sigma > 0
    for name, t in clean.items():
        if not is_aqn_target(name):
            assert torch.equal(noisy[name], t), name
            continue
        noise = noisy[name].float() - t.float()
        assert 0.5 * sigma < float(noise.std()) < 2.0 * sigma, name
    assert_same(dict(hf_tensors()), before)  # the trainer's tensors are untouched
    quantizer.step = 4
    again = slime_sync(spec.hf_quantization_config())
    name = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(again[name], noisy[name])


def test_init_hook_installs_and_checks_uaq(clean_shim, tmp_path):
    from megatron_qrl.config import QrlArgumentError
    from megatron_qrl.integrations.slime.hooks import qrl_megatron_init
    from megatron_qrl.integrations.slime.options import SPEC
    from megatron_qrl.integrations.slime.quantizer import installed_quantizer
    from megatron_qrl.models.convert import UAQ_CONFIG_KEY

    base = dict(qrl_loss_aggregation="seq_mean_token_mean", num_rollout=5,
                hf_checkpoint=str(tmp_path),
                custom_megatron_init_path="megatron_qrl.integrations.slime.hooks.qrl_megatron_init")
    qrl_megatron_init(slime_args(**base))
    assert installed_quantizer() is None  # bf16, no AQN: slime's own sync untouched
    qrl_megatron_init(slime_args(qrl_rollout_format="fp8", **base))
    assert installed_quantizer().spec.name == "fp8" and installed_quantizer().total_steps == 5
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(QrlArgumentError, match="UAQ is applied once, offline"):
        qrl_megatron_init(slime_args(qrl_uaq_scale=1.5, **base))
    (tmp_path / "config.json").write_text(json.dumps({UAQ_CONFIG_KEY: 1.5}))
    qrl_megatron_init(slime_args(qrl_uaq_scale=1.5, **base))
    # the aligned forward keeps TE's names (test_integrations_slime_aligned.py): accepted
    qrl_megatron_init(slime_args(qrl_rollout_format="int8", qrl_train_forward="aligned",
                                 spec=SPEC, **base))
    assert installed_quantizer().spec.name == "int8"


def spec_args(**kw):
    return slime_args(qrl_loss_aggregation="seq_mean_token_mean", transformer_impl="local",
                      custom_megatron_init_path="megatron_qrl.integrations.slime.hooks."
                                                "qrl_megatron_init",
                      num_experts=EXPERTS, moe_grouped_gemm=False, qk_layernorm=True,
                      multi_latent_attention=False, moe_use_legacy_grouped_gemm=False, **kw)


def build(args, upstream: bool = False):
    """slime's provider needs Megatron-LM's megatron.training (GPU image): build the GPTModel
    from the ``--spec`` function directly with megatron-core, as that provider does
    (``upstream``: from megatron-core's own decoder block spec, what slime uses without --spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_qrl.integrations.slime.model import qrl_layer_spec
    from megatron_qrl.models.builder import transformer_config
    from megatron_qrl.models.hf_config import arch_from_dict
    from tests.helpers.tiny_hf import tiny_config

    arch = arch_from_dict(tiny_config("moe", num_experts=EXPERTS))
    config = transformer_config(arch)
    spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False) if upstream
            else qrl_layer_spec(args, config, None))
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=arch.vocab_size, max_sequence_length=32)


def test_spec_and_hooks_install_the_aligned_forward(megatron_cpu):
    from megatron_qrl.integrations.slime.hooks import qrl_before_log_prob, qrl_before_train_step
    from megatron_qrl.integrations.slime.model import aligned_states
    from megatron_qrl.integrations.slime.options import SPEC
    from megatron_qrl.te_quant import AlignedColumnParallelLinear, AlignedRowParallelLinear

    plain = build(spec_args())
    off_types = [(n, type(m).__name__) for n, m in plain.named_modules()]
    assert off_types == [(n, type(m).__name__) for n, m in build(None, upstream=True).named_modules()]
    assert not aligned_states(plain)
    qrl_before_log_prob(spec_args(), [plain], "")  # options off: nothing to drive, no error
    args = spec_args(qrl_rollout_format="int8", qrl_train_forward="aligned", spec=SPEC)
    model = build(args)
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, AlignedColumnParallelLinear)
    assert isinstance(layer.mlp.experts.local_experts[0].linear_fc2, AlignedRowParallelLinear)
    assert [n for n, _ in model.named_modules()] == [n for n, _ in off_types]
    (state,) = aligned_states([model])
    version = state.version
    qrl_before_log_prob(args, [model], "")
    qrl_before_train_step(args, 0, 0, [model], None, None)
    assert state.version == version + 2 and state.spec.name == "int8"
    with pytest.raises(Exception, match="no aligned linears: add --spec"):
        qrl_before_log_prob(args, [plain], "")


@pytest.fixture(scope="module")
def megatron_cpu():
    from megatron_qrl.models.runtime import single_process_megatron

    with single_process_megatron():
        yield
