"""CALL-SEQUENCE checks only (no numerics): ``SGLangLoraEngine`` against a stand-in for
``sglang.Engine`` / its tokenizer manager — what is sent (names, config, sha256 receipt),
adapter names per version, unload of the previous adapter, the adapter named in every
generate request, memory release tags. Plus the in-place loader on the CPU stand-in of an
SGLang model whose layers were wrapped for LoRA (structure only). The numerics (engine
log-probs with a quantized base + adapter vs the reference) are GPU tests:
tests/gpu/test_sglang_lora.py."""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from megatron_qrl.rollout.base import WeightSyncError, tensor_checksum
from megatron_qrl.rollout_sglang import SGLangOptions
from megatron_qrl.rollout_sglang.lora import RELEASE_TAGS, SGLangLoraEngine, sha256_of
from tests.rollout_sglang.test_sglang_inplace import FakeModel, live_tensors, sync, weights


@dataclass
class _LoadReq:  # io_struct.LoadLoRAAdapterFromTensorsReqInput's fields we set
    lora_name: str
    config_dict: dict
    serialized_named_tensors: list
    load_format: str | None = None
    expected_checksums: dict | None = None


@dataclass
class _UnloadReq:
    lora_name: str


class _Bucket:  # sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket (named_tensors=)
    def __init__(self, named_tensors):
        self.named = list(named_tensors)

    def get_flattened_tensor(self):
        return self.named

    def get_metadata(self):
        return [n for n, _ in self.named]


class _TokenizerManager:
    def __init__(self, refuse=None):
        self.calls, self.loaded, self.refuse = [], {}, refuse

    async def load_lora_adapter_from_tensors(self, req, _):
        self.calls.append(("load", req.lora_name))
        (data,) = req.serialized_named_tensors
        tensors = dict(data["flattened_tensor"])
        if req.expected_checksums is not None:  # tp_worker's [LORA-CHECK]
            assert {n: sha256_of(t) for n, t in tensors.items()} == req.expected_checksums
        ok = req.lora_name != self.refuse and req.lora_name not in self.loaded
        if ok:
            self.loaded[req.lora_name] = (tensors, req.config_dict, req.load_format)
        return types.SimpleNamespace(success=ok, error_message="refused (stand-in)")

    async def unload_lora_adapter(self, req, _):
        self.calls.append(("unload", req.lora_name))
        return types.SimpleNamespace(success=self.loaded.pop(req.lora_name, None) is not None)


class _Engine:
    def __init__(self, refuse=None):
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = _TokenizerManager(refuse)
        self.generated, self.released = [], []

    def generate(self, **kw):
        self.generated.append(kw)
        return [{"output_ids": [1], "meta_info": {"output_token_logprobs": [(-0.5, 1)],
                                                  "finish_reason": {"type": "length"}}}
                for _ in kw["input_ids"]]

    def release_memory_occupation(self, tags=None):
        self.released.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.released.append(("resume", tags))


@pytest.fixture(autouse=True)
def fake_sglang(monkeypatch):
    io = types.ModuleType("sglang.srt.managers.io_struct")
    io.LoadLoRAAdapterFromTensorsReqInput, io.UnloadLoRAAdapterReqInput = _LoadReq, _UnloadReq
    utils = types.ModuleType("sglang.srt.utils")
    utils.MultiprocessingSerializer = types.SimpleNamespace(serialize=lambda d: d)
    bucket = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    bucket.FlattenedTensorBucket = _Bucket
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name, types.ModuleType(name)))
    for mod in (io, utils, bucket):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)


def _engine(receipt=True, refuse=None, targets=("q_proj", "o_proj")):
    eng = object.__new__(SGLangLoraEngine)  # no sglang.Engine: the stand-in above
    eng.options = SGLangOptions(sync="inplace", receipt=receipt).resolve("w4a16")
    eng.trainer_device, eng.processes, eng.returns_experts = torch.device("cpu"), 1, False
    eng.engine, eng.lora_targets = _Engine(refuse), tuple(targets)
    eng.lora_name, eng._lora_sent = None, {}
    eng._reset_sync_state()
    eng._version = 0  # as after the first (base) sync
    return eng


def _adapter(seed):
    g = torch.Generator().manual_seed(seed)
    p = "base_model.model.model.layers.0.self_attn."
    return {f"{p}q_proj.lora_A.weight": torch.randn(4, 8, generator=g),
            f"{p}q_proj.lora_B.weight": torch.randn(8, 4, generator=g)}


def test_each_version_loads_a_new_name_then_unloads_the_previous_one():
    from megatron_qrl.rollout.base import SamplingParams

    eng = _engine()
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    for v in (1, 2, 3):
        eng.load_lora_adapter(f"policy_v{v}", _adapter(v), cfg, version=v)
    tm = eng.engine.tokenizer_manager
    assert tm.calls == [("load", "policy_v1"), ("load", "policy_v2"), ("unload", "policy_v1"),
                        ("load", "policy_v3"), ("unload", "policy_v2")]
    assert list(tm.loaded) == ["policy_v3"] and eng.weight_version() == 3
    tensors, sent_cfg, fmt = tm.loaded["policy_v3"]
    assert sent_cfg == cfg and fmt == "flattened_bucket"
    assert eng.held_lora_checksums() == {n: tensor_checksum(t) for n, t in _adapter(3).items()}
    assert eng.last_sync["verified"] == "sha256" and eng.last_sync["tensors"] == 2
    eng.generate([[1, 2], [3]], SamplingParams(max_new_tokens=1))
    assert eng.engine.generated[-1]["lora_path"] == ["policy_v3", "policy_v3"]


def test_a_refused_adapter_fails_the_sync_and_keeps_the_served_one():
    eng = _engine(refuse="policy_v2")
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    eng.load_lora_adapter("policy_v1", _adapter(1), cfg, version=1)
    with pytest.raises(WeightSyncError, match="refused adapter 'policy_v2'"):
        eng.load_lora_adapter("policy_v2", _adapter(2), cfg, version=2)
    assert eng.lora_name == "policy_v1" and eng.weight_version() == 1
    assert ("unload", "policy_v1") not in eng.engine.tokenizer_manager.calls


def test_without_receipt_no_checksums_travel_and_release_keeps_weights():
    eng = _engine(receipt=False)
    eng.load_lora_adapter("a", _adapter(1), {"r": 4}, version=1)
    assert eng.last_sync["verified"] == "none"
    eng.release_memory()
    eng.resume_memory()
    assert eng.engine.released == [("release", RELEASE_TAGS), ("resume", RELEASE_TAGS)]
    assert "weights" not in RELEASE_TAGS


def test_adapter_before_the_base_or_without_targets_is_refused():
    eng = _engine()
    eng._version = -1
    with pytest.raises(WeightSyncError, match="before the first update_weights"):
        eng.load_lora_adapter("a", _adapter(1), {"r": 4}, version=1)
    eng = _engine(targets=())
    with pytest.raises(WeightSyncError, match="without LoRA targets"):
        eng.load_lora_adapter("a", _adapter(1), {"r": 4}, version=1)


# ---- the in-place loader on LoRA-wrapped layers (structure; CPU stand-in model) ----------
class BaseLayerWithLoRA(torch.nn.Module):
    """Shaped like sglang.srt.lora.layers.BaseLayerWithLoRA: holds the layer as
    ``base_layer`` and registers its ``weight`` under its own name too."""

    def __init__(self, base_layer):
        super().__init__()
        self.base_layer = base_layer
        if hasattr(base_layer, "weight"):
            self.weight = base_layer.weight


class FusedMoEWithLoRA(BaseLayerWithLoRA):
    def __init__(self, base_layer):
        super().__init__(base_layer)
        self.quant_method = base_layer.quant_method


def _wrap(model):
    layer = model.model.layers[0]
    for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj")):
        setattr(parent, name, BaseLayerWithLoRA(getattr(parent, name)))
    layer.mlp.experts = FusedMoEWithLoRA(layer.mlp.experts)
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.experts]


@pytest.mark.parametrize("per_bucket", [3, 100])
def test_inplace_sync_loads_the_base_layers_under_lora_wrappers(per_bucket):
    model = FakeModel()
    wrappers = _wrap(model)
    before = {k: t.data_ptr() for k, t in live_tensors(model).items()}
    sync(model, weights(1), per_bucket)
    layer = model.model.layers[0]
    assert [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.experts] == wrappers
    want = FakeModel(seed=1)
    _wrap(want)
    for k, t in live_tensors(model).items():
        assert t.data_ptr() == before[k], f"{k} lost its storage"
        torch.testing.assert_close(t, live_tensors(want)[k], rtol=0, atol=0, msg=k)


# ---- wiring: flags -> engine kwargs, and the LoRA combination checks ---------------------
def test_the_job_engine_of_a_lora_run_is_the_adapter_serving_engine(monkeypatch, tmp_path):
    import tempfile

    from megatron_qrl.rollout_sglang import factory, lora

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the engine's config directory
    from megatron_qrl.rollout.lora_serving import resolve_lora_serving
    from megatron_qrl.rollout_sglang.lora import lora_engine_kwargs

    made = []

    class Recorder:
        def __init__(self, path, fmt, options, **kw):
            made.append((fmt, kw))

    monkeypatch.setattr(lora, "SGLangLoraEngine", Recorder)
    cfg = types.SimpleNamespace(engine="sglang", format="w4a16", sglang=SGLangOptions())
    hf = {"num_hidden_layers": 1}
    serving = resolve_lora_serving("sglang", "w4a16", ("q_proj",), is_moe=True, experts=False)
    spec = factory.engine_spec(cfg, hf, 3, lora={"lora_rank": 8, "lora_serving": serving})
    factory.build_engine(spec)
    assert made == [("w4a16", {"load_format": "dummy", "random_seed": 3, "lora_rank": 8,
                                "lora_serving": serving})]
    assert lora_engine_kwargs(8, serving) == {
        "enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"],
        "max_loras_per_batch": 1}
    assert lora_engine_kwargs(8, resolve_lora_serving("sglang", "w4a16", ("gate_proj",),
                                                      is_moe=True, experts=False)) == {}


def _c(engine, fmt, forward="bf16", sync="auto", experts=False):
    from megatron_qrl.models.lora_config import LoraConfig

    return {"lora": LoraConfig(rank=4, experts=experts, base_format=fmt),
            "rollout": types.SimpleNamespace(engine=engine, format=fmt,
                                             sglang=SGLangOptions(sync=sync)),
            "train": types.SimpleNamespace(forward=forward),
            "uaq": types.SimpleNamespace(enabled=False)}


@pytest.mark.parametrize("c, cap, match", [
    (_c("sglang", "w4a16", sync="tensor"), (9, 0), "in-place loader"),
    (_c("sglang", "nvfp4", "aligned", experts=True), (10, 0), "merged into its base"),
    (_c("reference", "nvfp4", "aligned", experts=True), None, "fused experts"),
    (_c("sglang", "nvfp4", "aligned", experts=True), (9, 0), None),
    (_c("sglang", "w4a16", sync="inplace"), (9, 0), None),
    (_c("reference", "nvfp4", "bf16", experts=True), None, None),
])
def test_lora_engine_combinations(c, cap, match):
    from megatron_qrl.config.lora_checks import lora_problem

    got = lora_problem(c, types.SimpleNamespace(gpu_capability=cap))
    assert (got is None) if match is None else (match in got), got


# ---- the driver's calls (CALL SEQUENCE: a recording engine around the reference engine) --
class _Recording:
    """Stands in for the SGLang job engine: records the driver's calls, generates with the
    reference engine it wraps."""

    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    def update_weights(self, stream, version):
        self.calls.append(("weights", version))
        return self.inner.update_weights(stream, version)

    def load_lora_adapter(self, name, tensors, config, version):
        self.calls.append((name, version, tuple(config["target_modules"])))
        return self.inner.load_lora_adapter(name, tensors, config, version)

    def release_memory(self):
        self.calls.append(("release",))

    def resume_memory(self):
        self.calls.append(("resume",))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_driver_starts_the_sglang_engine_with_its_lora_targets_and_sends_adapters_only(
        megatron, tmp_path):
    import dataclasses

    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.driver import run_job
    from megatron_qrl.rollout_sglang.factory import make_engine
    from tests.rl.test_lora_driver import SMALL

    configs, flags, _ = parse_configs(["--qrl-preset", "tiny-cpu,qerl", *SMALL, "--qrl-steps",
                                       "2", "--qrl-output-dir", str(tmp_path)])
    configs["rollout"] = dataclasses.replace(configs["rollout"], engine="sglang")
    calls: list = []

    def factory(rollout_cfg, hf_config, seed, lora=None):
        calls.append(("start", lora))
        ref = dataclasses.replace(rollout_cfg, engine="reference")
        return _Recording(make_engine(ref, hf_config, seed), calls)

    run_job(configs, flags, engine_factory=factory, progress=False, log=lambda m: None)
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")  # MoE without expert adapters
    start = calls[0][1]
    assert calls[0][0] == "start" and start["lora_rank"] == 32
    assert start["lora_serving"].engine_targets == attn and start.keys() == {"lora_rank",
                                                                              "lora_serving"}
    assert start["lora_serving"].eager_reason is None  # no expert adapters: CUDA graphs on
    synced = [c for c in calls if c[0] not in ("release", "resume", "start")]
    # the base once (the first RL sync, version 4 after 4 warm-up steps), then one versioned
    # adapter per sync (after each of the 2 RL steps too)
    assert synced == [("weights", 4), ("policy_v4", 4, attn), ("policy_v5", 5, attn),
                      ("policy_v6", 6, attn)]
    assert ("release",) in calls and ("resume",) in calls
