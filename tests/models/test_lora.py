"""LoRA / QLoRA on megatron-core (one process): adapters, frozen base, merge, adapter-only sync.

Models: the format-friendly tiny Qwen3 of tests/helpers/te_quant_fixtures.py (hidden 256, head_dim
128), fp32 on CPU.
"""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.models.lora_config import LoraConfig
from megatron_qrl.rollout.base import tensor_checksum
from tests.helpers.te_quant_fixtures import (
    build,
    hf_state,
    ids,
    tiny_cfg,
    tiny_hf,
)

WEIGHT_FORMATS = ("int8", "fp8", "fp8_block", "w4a16", "nvfp4")


def _lora_model(cfg: LoraConfig, kind: str = "dense", seed: int = 0):
    from megatron_qrl.models.lora import LoraState, lora_spec_hook

    hf, arch = tiny_hf(kind, seed)
    state = LoraState(cfg)
    torch.manual_seed(seed)
    # the LoRA linears swap into the local spec (qrl-train pins it: rl/forward.py _lora_plan)
    return hf, arch, state, build(arch, hf_state(hf), lora_spec_hook(state), use_te=False)


def _freeze(model, fmt: str) -> int:
    from megatron_qrl.models.lora import freeze_base
    from megatron_qrl.models.lora_base import make_base_storage

    return freeze_base(model, make_base_storage(fmt))


def _logits(model, x):
    model.eval()
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    with torch.no_grad():
        return model(x, pos, None)


def _random_b(model, seed: int = 5) -> None:
    from megatron_qrl.models.lora import lora_linears

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, lin in lora_linears(model):
            for b in lin.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def test_zero_init_b_leaves_logits_unchanged(megatron):
    from megatron_qrl.models.lora import lora_linears

    hf, arch, state, model = _lora_model(LoraConfig(rank=8))
    plain = build(arch, hf_state(hf))
    n = _freeze(model, "bf16")
    assert n == 2 * 7 and state.active  # q,k,v,o,gate,up,down per layer
    assert all(float(b.abs().max()) == 0 for _, lin in lora_linears(model)
               for b in lin.lora_B.values())
    assert torch.equal(_logits(model, ids()), _logits(plain, ids()))
    _random_b(model)  # the same check fails once B is not zero
    assert not torch.allclose(_logits(model, ids()), _logits(plain, ids()))


def test_merged_weights_are_base_plus_scaled_b_a(megatron):
    from megatron_qrl.models.lora_io import adapter_tensors, base_hf_tensors, merge_into, peft_name

    cfg = LoraConfig(rank=4, alpha=16.0, targets=("q_proj", "v_proj", "down_proj"))
    hf, arch, _, model = _lora_model(cfg)
    _freeze(model, "bf16")
    _random_b(model)
    adapters = dict(adapter_tensors(model, arch))
    assert len(adapters) == 2 * 3 * arch.num_layers
    base = dict(base_hf_tensors(model, arch))
    merged = dict(merge_into(base.items(), adapters, cfg.scaling))
    for name, w in merged.items():
        a = adapters.get(peft_name(name, "A"))
        want = base[name] if a is None else base[name] + 4.0 * adapters[peft_name(name, "B")] @ a
        assert torch.allclose(w, want, atol=1e-6, rtol=0), name
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    # the merged model computes what the LoRA model computes
    plain = build(arch, merged)
    assert torch.allclose(_logits(plain, ids()), _logits(model, ids()), atol=1e-5, rtol=0)


def test_only_adapters_train_and_the_base_never_changes(megatron):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_qrl.models.lora_io import base_hf_tensors
    from megatron_qrl.rl.forward import ForwardPlan
    from megatron_qrl.rl.trainer import PolicyModel, make_optimizer

    _, arch, state, model = _lora_model(LoraConfig(rank=4))
    _freeze(model, "nvfp4")
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    opt = make_optimizer(ddp, 1e-2)
    PolicyModel(ddp, opt, model.config, arch, ForwardPlan(lora=state))
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in trained}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == sum(1 for n, _ in model.named_parameters() if ".lora_" in n)
    before = {n: tensor_checksum(t) for n, t in base_hf_tensors(model, arch)}
    buffers = {n: tensor_checksum(b) for n, b in model.named_buffers() if b is not None}
    for _ in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        model.train()
        x = ids()
        model(x, torch.arange(8)[None].expand_as(x), None).float().pow(2).mean().backward()
        assert opt.step()[0]
    after = {n: tensor_checksum(t) for n, t in base_hf_tensors(model, arch)}
    assert after == before
    assert {n: tensor_checksum(b) for n, b in model.named_buffers() if b is not None} == buffers
    assert any(float(p.abs().max()) > 0 for n, p in model.named_parameters() if ".lora_B." in n)


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_quantized_base_equals_the_aligned_forward_weight(megatron, fmt):
    """The base held as codes dequantizes to the rollout-aligned shard, bit for bit."""
    from megatron_qrl.models.lora import lora_linears
    from megatron_qrl.models.lora_base import storage_bytes
    from megatron_qrl.quant import get_spec
    from megatron_qrl.te_quant import FusionLayout, quantize_shard

    _, _, _, model = _lora_model(LoraConfig(rank=4), seed=1)
    weights = {n: lin.weight.detach().clone() for n, lin in lora_linears(model)}
    plain = sum(w.numel() * w.element_size() for w in weights.values())
    _freeze(model, fmt)
    spec = get_spec(fmt)
    for name, lin in lora_linears(model):
        s = lin.qrl_lora
        layout = FusionLayout(s.kind, s.heads_per_group, s.head_dim) if s.kind != "plain" \
            else FusionLayout()
        want = quantize_shard(spec, weights[name], layout, lin._qrl_parallel_dim, None, name)
        assert torch.equal(lin.qrl_base.dequantize(), want), name
    ratio = storage_bytes(model) / plain
    assert ratio < {"int8": 0.27, "fp8": 0.27, "fp8_block": 0.26, "w4a16": 0.14,
                    "nvfp4": 0.15}[fmt], ratio  # fp32 params: 4 bytes per weight


def test_nf4_base_storage(megatron):
    from megatron_qrl.models.lora import lora_linears
    from megatron_qrl.models.lora_base import storage_bytes
    from megatron_qrl.quant.nf4 import nf4_dequantize, nf4_quantize

    _, _, _, model = _lora_model(LoraConfig(rank=4), seed=2)
    weights = {n: lin.weight.detach().clone() for n, lin in lora_linears(model)}
    _freeze(model, "nf4")
    for name, lin in lora_linears(model):
        assert torch.equal(lin.qrl_base.dequantize(), nf4_dequantize(nf4_quantize(weights[name])))
    plain = sum(w.numel() * 4 for w in weights.values())
    assert storage_bytes(model) / plain < 4.2 / 32


def _engine(fmt: str):
    from megatron_qrl.rollout.reference import ReferenceEngine

    return ReferenceEngine(tiny_cfg("dense"), fmt, seed=0)


class _Counting:
    """Counts the full-weight updates an engine receives (the rest is passed through)."""

    def __init__(self, engine) -> None:
        self.engine, self.full = engine, 0

    def update_weights(self, *a, **k):
        self.full += 1
        return self.engine.update_weights(*a, **k)

    def __getattr__(self, name):
        return getattr(self.engine, name)


class _Trainer:
    def __init__(self, model, arch) -> None:
        from types import SimpleNamespace

        self.module = model
        self.policy = SimpleNamespace(arch=arch, groups=None)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "w4a16"])
def test_engine_reproduces_trainer_and_syncs_adapters_only(megatron, fmt):
    """First sync: base (packed) + adapter; later syncs: adapter only, fingerprinted. The
    engine (quantized base, adapter on top) computes the trainer's logits."""
    from megatron_qrl.models.lora_io import adapter_tensors
    from megatron_qrl.quant import get_spec
    from megatron_qrl.rl.lora_sync import LoraSync
    from megatron_qrl.rollout.base import WeightSyncError

    cfg = LoraConfig(rank=4, alpha=8.0, base_format=fmt)
    _, arch, _, model = _lora_model(cfg, seed=3)
    _freeze(model, fmt)
    engine = _Counting(_engine(fmt))
    sync, trainer, spec = LoraSync(cfg), _Trainer(model, arch), get_spec(fmt)
    sync.send(trainer, engine, spec, 1, None, 0, 0, 1)
    assert engine.full == 1 and engine.weight_version() == 1
    _random_b(model)
    res = sync.send(trainer, engine, spec, 2, None, 0, 0, 1)
    assert engine.full == 1 and engine.weight_version() == 2  # adapters only
    assert res.num_tensors == 2 * 7 * arch.num_layers
    want = {n: tensor_checksum(t) for n, t in adapter_tensors(model, arch)}
    assert engine.held_lora_checksums() == want
    from megatron_qrl.models.lora_io import base_hf_tensors
    from megatron_qrl.quant.hf_reference import hf_tensors

    held = dict(hf_tensors(engine.model))  # the engine's base == the trainer's, bit for bit
    # (on a CUDA host the trainer's tensors are on the GPU, the reference engine's on the CPU)
    assert all(torch.equal(held[n].cpu(), t.cpu()) for n, t in base_hf_tensors(model, arch)
               if n != "lm_head.weight" or n in held)
    x = ids(vocab=arch.vocab_size)
    got = engine.model(input_ids=x).logits
    assert torch.allclose(got, _logits(model, x), atol=1e-4, rtol=0)
    # a corrupted engine copy is caught by the fingerprints
    engine.adapter.tensors[next(iter(want))].add_(1.0)
    with pytest.raises(WeightSyncError, match="different"):
        from megatron_qrl.rollout.base import WeightManifest

        m = WeightManifest()
        list(m.record(adapter_tensors(model, arch)))
        m.compare(engine.held_lora_checksums())


def test_engine_refuses_expert_adapters_and_bad_shapes(megatron):
    from megatron_qrl.rollout.base import WeightSyncError

    eng = _engine("bf16")
    from megatron_qrl.quant.hf_reference import hf_tensors

    eng.update_weights(list(hf_tensors(eng.model)), version=0)
    cfg = LoraConfig(rank=2).peft_config()
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(WeightSyncError, match="do not fit"):
        eng.load_lora_adapter("x", {a: torch.zeros(2, 3), a.replace("_A", "_B"): torch.zeros(3, 2)},
                              cfg, 1)
    with pytest.raises(WeightSyncError, match="lacks"):
        eng.load_lora_adapter("x", {a: torch.zeros(2, 256)}, cfg, 1)


def test_without_warmup_ddp_holds_adapter_gradients_only(megatron):
    """``--qrl-sft-steps 0``: the base is frozen before megatron DDP wraps the model."""
    from types import SimpleNamespace

    from megatron_qrl.config import QrlConfigs
    from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
    from megatron_qrl.rl.forward import _lora_plan
    from megatron_qrl.rl.trainer import build_policy

    _, arch = tiny_hf("dense", 0)
    for warmup, expect_base in ((0, False), (3, True)):
        configs = QrlConfigs(lora=LoraConfig(rank=4), train=TrainForwardConfig(),
                             routing=RoutingReplayConfig(),
                             rollout=SimpleNamespace(format="bf16"),
                             run=SimpleNamespace(sft_steps=warmup))
        policy = build_policy(arch, 1e-3, _lora_plan(configs, arch))
        with_grad = {n for n, p in policy.ddp.module.named_parameters() if hasattr(p, "main_grad")}
        assert any(".lora_B." in n for n in with_grad)
        assert any(".lora_" not in n for n in with_grad) == expect_base, warmup


def test_explicit_transformer_engine_with_lora_is_refused_naming_both_flags(megatron):
    """LoRA pins the local spec; an explicit ``--transformer-impl transformer_engine`` is not
    silently overridden (auto picks local for LoRA)."""
    from types import SimpleNamespace

    from megatron_qrl.config import QrlConfigs
    from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
    from megatron_qrl.rl.forward import _lora_plan
    from megatron_qrl.rl.trainer import TrainerOptions, build_policy

    _, arch = tiny_hf("dense", 0)
    configs = QrlConfigs(lora=LoraConfig(rank=4), train=TrainForwardConfig(),
                         routing=RoutingReplayConfig(), rollout=SimpleNamespace(format="bf16"),
                         run=SimpleNamespace(sft_steps=0))
    plan = _lora_plan(configs, arch)
    with pytest.raises(ValueError, match="--transformer-impl transformer_engine with --qrl-lora"):
        build_policy(arch, 1e-3, plan, options=TrainerOptions(transformer_impl="transformer_engine"))
    assert build_policy(arch, 1e-3, _lora_plan(configs, arch),
                        options=TrainerOptions(transformer_impl="auto")) is not None
