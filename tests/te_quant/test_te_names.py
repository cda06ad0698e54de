"""The aligned forward on Megatron's Transformer Engine spec keeps TE's names (CPU, gloo).

The TE spec tree is megatron-core's own (``tests/helpers/te_spec_cpu.py``: megatron's spec functions
with a provider returning megatron's TE wrappers in TESpecProvider's places). Expected names
are written out here from the upstream sources, not from te_quant:
- ``TELayerNormColumnParallelLinear`` = TE ``LayerNormLinear``: ``layer_norm_weight``
  (+ ``layer_norm_bias`` for LayerNorm), ``weight``; ``TEColumnParallelLinear`` /
  ``TERowParallelLinear`` = TE ``Linear``: ``weight``; ``TE*GroupedLinear`` = TE
  ``GroupedLinear``: ``weight0 .. weight{n-1}``; every TE module: ``_extra_state`` (an empty
  uint8 tensor without FP8), TE ``module/base.py``.
- parameter attributes: TE ``reset_parameters`` / ``set_tensor_parallel_attributes`` (weights
  ``tensor_model_parallel``, ``partition_dim`` 1 only in TE's "row" mode, which Megatron's
  expert wrappers with explicit communication leave unset), norm gains ``sequence_parallel``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.mp_utils import run_distributed
from tests.helpers.te_quant_fixtures import (
    FLIP_BATCH,
    assert_close_up_to_flips,
    grads_as_hf,
    hf_state,
    ids,
    quiet_torch_trace,
    tiny_hf,
)
from tests.helpers.te_spec_cpu import build_te_shaped

GQA_TP2 = {"num_attention_heads": 4, "num_key_value_heads": 2}
CASES = [("dense", False), ("moe", False), ("moe", True)]
CASE_IDS = ["dense", "moe-sequential", "moe-grouped"]


def te_layer_names(kind: str, grouped: bool, experts: int) -> tuple[set[str], set[str]]:
    """(parameters, ``_extra_state`` keys) of decoder layer 0 on Megatron's TE spec."""
    params = {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
              "self_attention.linear_proj.weight", "self_attention.q_layernorm.weight",
              "self_attention.k_layernorm.weight"}
    extra = {"self_attention.linear_qkv._extra_state", "self_attention.linear_proj._extra_state"}
    if kind == "dense":
        params |= {"mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
                   "mlp.linear_fc2.weight"}
        extra |= {"mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state"}
    else:
        params |= {"pre_mlp_layernorm.weight", "mlp.router.weight"}
        fcs = ("linear_fc1", "linear_fc2")
        if grouped:
            params |= {f"mlp.experts.{fc}.weight{e}" for fc in fcs for e in range(experts)}
            extra |= {f"mlp.experts.{fc}._extra_state" for fc in fcs}
        else:
            params |= {f"mlp.experts.local_experts.{e}.{fc}.weight" for fc in fcs
                       for e in range(experts)}
            extra |= {f"mlp.experts.local_experts.{e}.{fc}._extra_state" for fc in fcs
                      for e in range(experts)}
    return params, extra


def _layer0(names) -> set[str]:
    p = "decoder.layers.0."
    return {n[len(p):] for n in names if n.startswith(p) and "core_attention" not in n}


def aligned_te(arch, tensors, fmt="int8", layout=None, grouped=False):
    from megatron_qrl.models.streaming import groups_from_parallel_state, load_hf_weights
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook

    state = AlignedForwardState(fmt)
    kw = {"layout": layout} if layout is not None else {}
    model = build_te_shaped(arch, aligned_spec_hook(state), moe_grouped_gemm=grouped, **kw)
    load_hf_weights(model, arch, tensors.__getitem__, groups_from_parallel_state())
    return state, model.eval()


@pytest.mark.parametrize("kind,grouped", CASES, ids=CASE_IDS)
def test_aligned_te_spec_keeps_te_parameter_and_state_dict_names(megatron, kind, grouped):
    hf, arch = tiny_hf(kind)
    _, model = aligned_te(arch, hf_state(hf), grouped=grouped)
    params, extra = te_layer_names(kind, grouped, arch.num_experts if kind == "moe" else 0)
    assert _layer0(n for n, _ in model.named_parameters()) == params
    sd = model.state_dict()
    assert _layer0(sd) == params | extra
    for key in extra:
        value = sd[f"decoder.layers.0.{key}"]
        assert value.dtype == torch.uint8 and value.numel() == 0, key
    layer = model.decoder.layers[0]
    qkv = layer.self_attention.linear_qkv
    assert [n for n, _ in qkv.named_parameters()] == ["layer_norm_weight", "weight"]
    assert qkv.layer_norm_weight.sequence_parallel is False  # TP = 1
    want = {qkv.weight: 0, layer.self_attention.linear_proj.weight: 1}
    if grouped:
        want |= {layer.mlp.experts.linear_fc1.weight0: 0, layer.mlp.experts.linear_fc2.weight0: 1}
    for param, dim in want.items():
        assert (param.tensor_model_parallel, param.partition_dim, param.partition_stride) == (
            True, dim, 1)


def test_extra_state_round_trip(megatron):
    """A TE checkpoint's ``_extra_state`` (pickled FP8 metadata, uint8) loads strictly and is
    written back for the linears; a local-spec one (None) loads too; the grouped linears save
    an empty one (TE's per-expert merge is not reproduced)."""
    hf, arch = tiny_hf("moe")
    _, model = aligned_te(arch, hf_state(hf), grouped=True)
    sd = model.state_dict()
    qkv, fc1 = ("decoder.layers.0.self_attention.linear_qkv._extra_state",
                "decoder.layers.0.mlp.experts.linear_fc1._extra_state")
    blob = torch.frombuffer(bytearray(b"te fp8 metadata"), dtype=torch.uint8)
    sd[qkv], sd[fc1] = blob, blob
    model.load_state_dict(sd, strict=True)
    again = model.state_dict()
    assert torch.equal(again[qkv], blob) and again[fc1].numel() == 0
    sd[qkv] = None
    model.load_state_dict(sd, strict=True)
    assert model.state_dict()[qkv].numel() == 0
    with pytest.raises(TypeError, match="uint8 tensor"):
        model.decoder.layers[0].self_attention.linear_qkv.set_extra_state({"fp8": 1})


@pytest.mark.parametrize("normalization,zero_centered", [("LayerNorm", True), ("RMSNorm", False)])
def test_fused_norm_linear_layernorm_and_zero_centered_gamma(megatron, normalization,
                                                             zero_centered):
    """TE LayerNormLinear's parameters for LayerNorm (``layer_norm_bias`` too) and its maths:
    ``norm(x) @ W^T`` with gain ``1 + g`` under ``layernorm_zero_centered_gamma``."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    from megatron_qrl.te_quant import AlignedForwardState, AlignedTELayerNormColumnParallelLinear

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2,
                            normalization=normalization, layernorm_epsilon=1e-5,
                            layernorm_zero_centered_gamma=zero_centered,
                            use_cpu_initialization=True, gradient_accumulation_fusion=False)
    state = AlignedForwardState("int8")
    lin = AlignedTELayerNormColumnParallelLinear(
        64, 32, config=cfg, init_method=torch.nn.init.normal_, gather_output=False, bias=False,
        skip_bias_add=True, is_expert=False, tp_comm_buffer_name="qkv", qrl_state=state,
        qrl_kind="attention")
    names = ["layer_norm_weight"] + (["layer_norm_bias"] if normalization == "LayerNorm" else [])
    assert [n for n, _ in lin.named_parameters()] == names + ["weight"]
    assert torch.equal(lin.layer_norm_weight, torch.full((64,), 0.0 if zero_centered else 1.0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lin.layer_norm_weight.normal_(0.0, 0.3, generator=g)
        if normalization == "LayerNorm":
            lin.layer_norm_bias.normal_(0.0, 0.3, generator=g)
    x = torch.randn(5, 2, 64, generator=g)
    gain = lin.layer_norm_weight + (1.0 if zero_centered else 0.0)
    ref = (F.layer_norm(x, (64,), gain, lin.layer_norm_bias, 1e-5) if normalization == "LayerNorm"
           else x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * gain)
    with state.only(()):
        out, bias = lin(x)
    assert bias is None and torch.allclose(out, ref @ lin.weight.t(), atol=1e-5)


def test_qrl_train_forward_on_te_spec_keeps_te_names(megatron):
    """qrl-train's trainer forward (aligned + routing replay hooks) on the TE spec: TE names."""
    from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
    from megatron_qrl.te_quant import AlignedTEGroupedMLP, trainer_forward

    _, arch = tiny_hf("moe")
    fwd = trainer_forward(TrainForwardConfig("aligned"), "int8", RoutingReplayConfig("all"), arch)
    model = build_te_shaped(arch, fwd.spec_hook, moe_grouped_gemm=True)
    assert isinstance(model.decoder.layers[0].mlp.experts, AlignedTEGroupedMLP)
    params, extra = te_layer_names("moe", True, arch.num_experts)
    assert _layer0(n for n, _ in model.named_parameters()) == params
    assert _layer0(model.state_dict()) == params | extra


@pytest.mark.parametrize("kind,grouped", CASES, ids=CASE_IDS)
def test_aligned_te_spec_equals_aligned_local_spec(megatron, kind, grouped):
    """Same weights: the TE-named aligned model computes what the local-spec aligned model does,
    every format (logits), and the same gradients (W8A8 and a weight-only format)."""
    from megatron_qrl.quant import get_spec, list_specs
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook
    from megatron_qrl.te_quant.attribution import megatron_logits
    from tests.helpers.te_quant_fixtures import build

    hf, arch = tiny_hf(kind)
    tensors = hf_state(hf)
    te_state, te_model = aligned_te(arch, tensors, "bf16", grouped=grouped)
    loc_state = AlignedForwardState("bf16")
    loc_model = build(arch, tensors, aligned_spec_hook(loc_state)).eval()
    x = ids(**FLIP_BATCH)
    diffs = {}
    for fmt in list_specs():
        for state in (te_state, loc_state):
            state.spec = get_spec(fmt)
            state.mark_weights_updated()
        got, want = megatron_logits(te_model, x), megatron_logits(loc_model, x)
        diffs[fmt] = (got - want).abs().max().item()
    print(f"\n{kind} grouped={grouped}: max |TE-named - local| logits per format:", diffs)
    assert max(diffs.values()) <= 1e-5, diffs
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    for fmt in ("int8", "nvfp4"):
        grads = []
        for state, model in ((te_state, te_model), (loc_state, loc_model)):
            state.spec = get_spec(fmt)
            state.mark_weights_updated()
            model.zero_grad()
            model(x, pos, attention_mask=None).float().square().mean().backward()
            grads.append(grads_as_hf(model, arch))
        assert sorted(grads[0]) == sorted(grads[1])
        worst = max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[1])
        assert worst <= 1e-5, (fmt, worst)


def test_grouped_sharded_state_dict_is_sequential_mlps(megatron):
    """torch_dist keys: the aligned TE-grouped model's sharded state dict has the keys, global
    shapes and offsets of the local spec's (SequentialMLP; megatron: interchangeable), and a
    checkpoint saved from the plain local model loads into it."""
    from megatron.core import dist_checkpointing

    from megatron_qrl.te_quant.attribution import megatron_logits
    from tests.helpers.te_quant_fixtures import build

    hf, arch = tiny_hf("moe")
    tensors = hf_state(hf)
    state, te_model = aligned_te(arch, tensors, grouped=True)
    local = build(arch, tensors).eval()

    def layout(model):
        out = {}
        for sh in model.sharded_state_dict().values():
            shard = (tuple(sh.global_shape), tuple(sh.global_offset)) if hasattr(
                sh, "global_shape") else ()
            out[(sh.key, *shard)] = type(sh).__name__
        return out

    def flat(model):  # ShardedTensorFactory (gate/up) built lazily: compare its key only
        return {k[0] if v == "ShardedTensorFactory" else k for k, v in layout(model).items()}

    # megatron's local spec maps ``pre_mlp_layernorm.`` to the dense TE name
    # ``mlp.linear_fc1.layer_norm_`` in MoE layers too (get_gpt_layer_local_spec's
    # sharded_state_dict_keys_map); the TE spec keeps ``pre_mlp_layernorm`` there
    quirk = ("decoder.layers.pre_mlp_layernorm.weight",
             "decoder.layers.mlp.linear_fc1.layer_norm_weight")
    te_keys = {(quirk[1], *k[1:]) if isinstance(k, tuple) and k[0] == quirk[0] else k
               for k in flat(te_model)}
    assert te_keys == flat(local)
    assert any("experts.experts.linear_fc1.weight" in str(k) for k in te_keys)
    with torch.no_grad():
        for p in te_model.parameters():
            p.zero_()
    import tempfile

    target = te_model.sharded_state_dict()
    for sh in target.values():
        if sh.key == quirk[0]:
            sh.key = quirk[1]
    from megatron_qrl.compat.dist_ckpt_cpu import cuda_synchronize_noop

    with tempfile.TemporaryDirectory() as tmp, cuda_synchronize_noop():
        dist_checkpointing.save(local.sharded_state_dict(), tmp)
        loaded = dist_checkpointing.load(target, tmp)
    te_model.load_state_dict(loaded, strict=True)
    x = ids(**FLIP_BATCH)
    with state.only(()):
        got = megatron_logits(te_model, x)
    assert torch.equal(got, megatron_logits(local, x))


def _hf_grads(model, arch, x) -> dict[str, torch.Tensor]:
    """HF-named weight gradients of ``sum(logits^2)`` (vocab shards: each rank's share), with
    megatron's finalize rule for replicated sequence-parallel parameters (norm gains, router):
    their gradient is all-reduced over TP. A gain missing ``.sequence_parallel`` stays partial."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_qrl.models.streaming import groups_from_parallel_state, iter_hf_tensors

    pos = torch.arange(x.shape[1])[None].expand_as(x)
    model.zero_grad()
    model(x, pos, attention_mask=None).float().square().sum().backward()
    tp = ps.get_tensor_model_parallel_group()
    named = []
    for name, p in model.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        if ps.get_tensor_model_parallel_world_size() > 1 and getattr(p, "sequence_parallel",
                                                                      False):
            dist.all_reduce(grad, group=tp)
        named.append((name, grad))
    return dict(iter_hf_tensors(model, arch, groups_from_parallel_state(), named=named))


def _tp_worker(rank, world_size, port, kind, grouped, tensors, x, formats):
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.hf_config import arch_from_dict
    from megatron_qrl.quant import get_spec
    from megatron_qrl.te_quant.attribution import megatron_logits
    from tests.helpers.te_quant_fixtures import tiny_cfg

    etp = world_size if kind == "moe" else None
    init_cpu_distributed(rank, world_size, port, tp=world_size, etp=etp)
    try:
        with quiet_torch_trace(), cpu_device_mode():
            arch = arch_from_dict(tiny_cfg(kind, **GQA_TP2))
            layout = ParallelLayout(tp=world_size, etp=etp or 1)
            state, model = aligned_te(arch, tensors, layout=layout, grouped=grouped)
            out = {}
            for fmt in formats:
                state.spec = get_spec(fmt)
                state.mark_weights_updated()
                out[fmt] = megatron_logits(model, x)
            out["grads"] = _hf_grads(model, arch, x)
            layer = model.decoder.layers[0]
            attrs = {"qkv_norm_sp": layer.self_attention.linear_qkv.layer_norm_weight
                     .sequence_parallel}
            if grouped:
                fc2 = layer.mlp.experts.linear_fc2
                attrs["fc2_dim"] = fc2.weight0.partition_dim
                attrs["fc2_shape"] = tuple(fc2.weight0.shape)
            out["attrs"] = attrs
            return out
    finally:
        destroy_cpu_distributed()


@pytest.mark.slow
@pytest.mark.parametrize("kind,grouped", [("dense", False), ("moe", True)],
                         ids=["dense", "moe-grouped"])
def test_tp2_equals_tp1(kind, grouped):
    """TP = 2 (sequence parallel; experts split over expert-TP = 2) == TP = 1, TE names."""
    hf, arch = tiny_hf(kind, **GQA_TP2)
    tensors, x = hf_state(hf), ids(**FLIP_BATCH)
    formats = ["int8", "fp8", "nvfp4"]  # the gradients are taken with the last
    (ref,) = run_distributed(_tp_worker, 1, kind, grouped, tensors, x, formats)
    got = run_distributed(_tp_worker, 2, kind, grouped, tensors, x, formats)
    for fmt in formats:
        for out in got:
            assert_close_up_to_flips(out[fmt], ref[fmt], f"{kind} {fmt} TP2 vs TP1")
    for out in got:  # gradients of the last format (weight-only: no activation rounding flips)
        assert sorted(out["grads"]) == sorted(ref["grads"])
        for name, g in ref["grads"].items():
            err = (out["grads"][name] - g).abs().max().item()
            assert err <= 1e-4 * g.abs().max().item() + 1e-6, (name, err)
    assert ref["attrs"]["qkv_norm_sp"] is False and got[0]["attrs"]["qkv_norm_sp"] is True
    if grouped:  # TE's mode None under explicit expert communication: partition_dim 0
        assert ref["attrs"]["fc2_dim"] == 1 and got[0]["attrs"]["fc2_dim"] == 0
        assert got[0]["attrs"]["fc2_shape"] == (arch.hidden_size, arch.moe_ffn_hidden_size // 2)
