"""SDPA core attention (models.sdpa_attention) == megatron-core's DotProductAttention on CPU.

Both modules get the same query / key / value ``[s, b, heads, dim]`` (GQA: fewer key/value
heads) and the same upstream config; outputs and the gradients into q, k, v must agree (fp64,
so the only difference is summation order). The local spec of models.builder must use it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.models.runtime import single_process_megatron


@pytest.fixture(scope="module")
def megatron():
    with single_process_megatron():
        yield


def _config(heads: int, groups: int, dim: int, **kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=dim, attention_dropout=0.0,
                             hidden_dropout=0.0, use_cpu_initialization=True,
                             masked_softmax_fusion=False, params_dtype=torch.float64, **kw)


def _both(config, mask_type):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_qrl.models.sdpa_attention import SDPACoreAttention

    kw = dict(config=config, layer_number=3, attn_mask_type=mask_type, attention_type="self")
    return DotProductAttention(**kw), SDPACoreAttention(**kw)


def _run(module, q, k, v, mask):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, mask)
    torch.manual_seed(7)
    out.backward(torch.randn_like(out))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("s,b,heads,groups,dim", [
    (7, 2, 4, 4, 8),     # multi-head
    (16, 3, 8, 2, 16),   # GQA 4:1
    (5, 1, 6, 3, 4),     # GQA 2:1, odd length
    (1, 2, 4, 1, 8),     # one token (no causal mask, as upstream)
])
@pytest.mark.parametrize("scaling", [False, True])
def test_sdpa_equals_dot_product_attention_causal(megatron, s, b, heads, groups, dim, scaling):
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(heads, groups, dim, apply_query_key_layer_scaling=scaling,
                     attention_softmax_in_fp32=True)
    ref, sdpa = _both(config, AttnMaskType.causal)
    g = torch.Generator().manual_seed(s * 100 + heads)
    q = torch.randn(s, b, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(s, b, groups, dim, generator=g, dtype=torch.float64)
    v = torch.randn(s, b, groups, dim, generator=g, dtype=torch.float64)
    want, got = _run(ref, q, k, v, None), _run(sdpa, q, k, v, None)
    assert got[0].shape == (s, b, heads * dim)
    for name, w, x in zip(("out", "dq", "dk", "dv"), want, got):
        torch.testing.assert_close(x, w, rtol=1e-10, atol=1e-10, msg=name)


def test_sdpa_equals_dot_product_attention_with_padding_mask(megatron):
    """An explicit boolean mask (True = masked out, causal + a padded tail per row)."""
    from megatron.core.transformer.enums import AttnMaskType

    s, b, heads, groups, dim = 9, 2, 4, 2, 8
    ref, sdpa = _both(_config(heads, groups, dim), AttnMaskType.padding)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, b, n, dim, generator=g, dtype=torch.float64)
               for n in (heads, groups, groups))
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    mask = causal.expand(b, 1, s, s).clone()
    mask[1, :, :, 6:] = True  # row 1's keys 6.. are padding
    mask[1, :, 6:, :] = False  # ...its padded queries attend everywhere (no empty row)
    want, got = _run(ref, q, k, v, mask), _run(sdpa, q, k, v, mask)
    for name, w, x in zip(("out", "dq", "dk", "dv"), want, got):
        torch.testing.assert_close(x, w, rtol=1e-10, atol=1e-10, msg=name)


def test_local_spec_uses_sdpa_and_bad_packed_params_raise(megatron):
    from megatron_qrl.data import CharTokenizer, tiny_dense_config
    from megatron_qrl.models.builder import config_and_spec
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.models.sdpa_attention import SDPACoreAttention

    arch = arch_from_dict(tiny_dense_config(CharTokenizer().vocab_size))
    _, block = config_and_spec(arch, use_te="local")
    core = block.layer_specs[0].submodules.self_attention.submodules.core_attention
    assert core is SDPACoreAttention
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    module = SDPACoreAttention(_config(2, 1, 4), 1, AttnMaskType.causal, "self")
    x = torch.zeros(3, 2, 4, dtype=torch.float64)  # packed THD (tests/rl/test_packed_sequences.py)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="'thd'"):
        module(x, x[:, :1], x[:, :1], None, packed_seq_params=PackedSeqParams(
            qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
    with pytest.raises(ValueError, match="cu_seqlens ends at 2"):
        module(x, x[:, :1], x[:, :1], None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu - cu.sign(), cu_seqlens_kv=cu - cu.sign()))
    with pytest.raises(ValueError, match="transformer-impl"):
        config_and_spec(arch, use_te="transformer_engine")


def test_transformer_impl_resolution():
    from megatron_qrl.models.builder import resolve_transformer_impl, use_transformer_engine

    assert resolve_transformer_impl("local") is False and resolve_transformer_impl(True) is True
    auto = use_transformer_engine() and torch.cuda.is_available()
    assert resolve_transformer_impl(None) == resolve_transformer_impl("auto") == auto
    with pytest.raises(ValueError, match="choose one of"):
        resolve_transformer_impl("te")


def test_grouped_gemm_needs_the_te_spec(megatron):
    from megatron_qrl.data import CharTokenizer, tiny_moe_config
    from megatron_qrl.models.builder import config_and_spec
    from megatron_qrl.models.hf_config import arch_from_dict

    arch = arch_from_dict(tiny_moe_config(CharTokenizer().vocab_size))
    with pytest.raises(ValueError, match="--moe-grouped-gemm"):
        config_and_spec(arch, use_te="local", moe_grouped_gemm=True)
