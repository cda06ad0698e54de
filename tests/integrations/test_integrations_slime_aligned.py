"""megatron_qrl inside slime: ``--qrl-train-forward aligned`` on slime's default (Transformer
Engine) layer spec — built through ``--spec ... qrl_layer_spec`` from megatron's TE spec tree
(``tests/helpers/te_spec_cpu.py``), driven by the hooks, and synced through slime 0.3.1's own
``convert_to_hf`` (qwen3moe / qwen2 converters), which must take every parameter name of the
aligned model and return the HF checkpoint's tensors. slime is found as in
test_integrations_slime.py; without it these tests skip with the reason."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.integrations.test_integrations_slime import SKIP, slime_args

pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

SLIME_MODEL = {"moe": "qwen3moe", "dense": "qwen3"}  # slime's --model-name dispatch


@pytest.fixture(scope="module")
def megatron_cpu():
    from megatron_qrl.models.runtime import single_process_megatron
    from tests.helpers.te_quant_fixtures import quiet_torch_trace

    with quiet_torch_trace(), single_process_megatron():
        yield


@pytest.fixture
def no_shim():
    from megatron_qrl.integrations.slime.quantizer import uninstall_quantizer

    uninstall_quantizer()
    yield
    uninstall_quantizer()


def te_args(arch, **kw):
    """slime's model flags (TE impl, grouped experts as slime's Qwen3-MoE script) + qrl keys."""
    return slime_args(qrl_loss_aggregation="seq_mean_token_mean",
                      transformer_impl="transformer_engine",
                      custom_megatron_init_path="megatron_qrl.integrations.slime.hooks."
                                                "qrl_megatron_init",
                      num_experts=arch.num_experts if arch.is_moe else None,
                      moe_grouped_gemm=arch.is_moe, qk_layernorm=True,
                      multi_latent_attention=False, moe_use_legacy_grouped_gemm=False, **kw)


def build_via_spec(arch, args, tensors, layout=None):
    """slime's provider builds GPTModel(config, qrl_layer_spec(args, config, vp_stage)); its
    module needs Megatron-LM's megatron.training (GPU image), so the same call is made here."""
    from megatron_qrl.compat.moe_cpu import enable_moe_router_without_te
    from megatron_qrl.integrations.slime.model import qrl_layer_spec
    from megatron_qrl.models.builder import build_gpt_model, transformer_config
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from tests.helpers.te_spec_cpu import te_spec_on_cpu

    extra = {"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": True} if arch.is_moe else {}
    config = transformer_config(arch, layout, use_te=True, use_cpu_initialization=True, **extra)
    enable_moe_router_without_te()  # as models.runtime.build_model does without TE
    with te_spec_on_cpu():
        model = build_gpt_model(arch, config, qrl_layer_spec(args, config, None))
    load_hf_weights(model, arch, tensors.__getitem__, groups_from_parallel_state())
    return model.eval()


def convert_args(arch) -> argparse.Namespace:
    return argparse.Namespace(vocab_size=arch.vocab_size, kv_channels=arch.head_dim,
                              hidden_size=arch.hidden_size, num_attention_heads=arch.num_heads,
                              num_query_groups=arch.num_kv_heads, q_lora_rank=None)


def slime_convert(model, arch, kind) -> dict[str, torch.Tensor]:
    """What slime's weight sync converts: every parameter under slime's DDP-wrapped name."""
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf

    args = convert_args(arch)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        for hf_name, t in convert_to_hf(args, SLIME_MODEL[kind], f"module.module.{name}",
                                        param.detach(), None):
            assert hf_name not in out, hf_name
            out[hf_name] = t
    return out


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_slime_converter_takes_the_aligned_model(megatron_cpu, no_shim, kind):
    from megatron_qrl.integrations.slime.hooks import qrl_before_log_prob, qrl_before_train_step
    from megatron_qrl.integrations.slime.model import aligned_states
    from megatron_qrl.integrations.slime.options import SPEC
    from megatron_qrl.te_quant.te_names import AlignedTELayerNormColumnParallelLinear
    from tests.helpers.te_quant_fixtures import hf_state, ids, tiny_hf

    hf, arch = tiny_hf(kind)
    tensors = hf_state(hf)
    args = te_args(arch, qrl_rollout_format="int8", qrl_train_forward="aligned", spec=SPEC)
    model = build_via_spec(arch, args, tensors)
    got = slime_convert(model, arch, kind)
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(got[name], t), name
    assert isinstance(model.decoder.layers[0].self_attention.linear_qkv,
                      AlignedTELayerNormColumnParallelLinear)
    (state,) = aligned_states([model])
    version = state.version
    qrl_before_log_prob(args, [model], "")
    qrl_before_train_step(args, 0, 0, [model], None, None)
    assert state.version == version + 2 and state.spec.name == "int8"
    x = ids()
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    with torch.no_grad():
        aligned = model(x, pos, attention_mask=None)
        with state.only(()):
            plain = model(x, pos, attention_mask=None)
    assert (aligned - plain).abs().max() > 1e-3  # int8 weights (and activations) really used


GQA_TP2 = {"num_attention_heads": 4, "num_key_value_heads": 2}


class _Float16ModuleLike(torch.nn.Module):
    """slime names parameters as under megatron's Float16Module (``module.``) + DDP."""

    def __init__(self, model):
        super().__init__()
        self.module, self.config = model, model.config


def _slime_sync_worker(rank, world_size, port, tensors):
    from megatron.core.tensor_parallel import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
    )
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
    from slime.backends.megatron_utils.update_weight.common import (
        _named_params_and_buffers_global,
        all_gather_param,
    )

    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.integrations.slime.options import SPEC
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.hf_config import arch_from_dict
    from tests.helpers.te_quant_fixtures import quiet_torch_trace, tiny_cfg

    init_cpu_distributed(rank, world_size, port, tp=world_size, etp=world_size)
    try:
        with quiet_torch_trace(), cpu_device_mode():
            arch = arch_from_dict(tiny_cfg("moe", **GQA_TP2))
            args = te_args(arch, qrl_rollout_format="int8", qrl_train_forward="aligned", spec=SPEC)
            model = build_via_spec(arch, args, tensors, ParallelLayout(tp=world_size,
                                                                       etp=world_size))
            for p in model.parameters():  # megatron.training's get_model does this
                set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            out = {}
            for name, param in _named_params_and_buffers_global(args, [_Float16ModuleLike(model)]):
                full = all_gather_param(name, param)
                for hf_name, t in convert_to_hf(convert_args(arch), "qwen3moe", name, full, None):
                    out[hf_name] = t
            return out
    finally:
        destroy_cpu_distributed()


@pytest.mark.slow
def test_slime_tp2_sync_of_the_aligned_model(no_shim):
    """slime's own TP all-gather (``update_weight.common.all_gather_param``: it reads the
    parameters' ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``) and
    converter on the aligned model at TP = expert TP = 2 give the HF checkpoint back."""
    from tests.helpers.mp_utils import run_distributed
    from tests.helpers.te_quant_fixtures import hf_state, tiny_hf

    hf, _ = tiny_hf("moe", **GQA_TP2)
    tensors = hf_state(hf)
    for got in run_distributed(_slime_sync_worker, 2, tensors):
        assert sorted(got) == sorted(tensors)
        for name, t in tensors.items():
            assert torch.equal(got[name], t), name
