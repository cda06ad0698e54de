"""Batched direct expert loads (megatron_qrl.rollout_sglang.sync.loader.expert_batch) against per-tensor
``FusedMoE.weight_loader`` calls, on the SGLang-like fake of tests/rollout_sglang/sglang_fused_moe_fake.py:
bit-identical parameters for every parameter kind batched (TP=1, both ranks of TP=2, EP, an
expert-location map), per-tensor fallback for what is not reproduced, buckets that split a
module's experts, and the in-place loader's shard-load check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_qrl.rollout_sglang.sync.loader import experts as expert_loads
from megatron_qrl.rollout_sglang.sync.loader import load_packed
from megatron_qrl.rollout_sglang.sync.sender import StreamTracker
from tests.rollout_sglang import sglang_fused_moe_fake as fake

E, H, N = 4, 32, 32  # experts, hidden, moe_intermediate_size (full, before TP)
PRE = "model.layers.0.mlp.experts"
F8 = torch.float8_e4m3fn


def _rand(shape, dtype, g):
    if dtype == F8 or dtype.is_floating_point:
        return (torch.rand(shape, generator=g) + 0.5).to(dtype)
    hi = 2 ** 31 - 1 if dtype == torch.int32 else 127
    return torch.randint(-hi, hi, shape, generator=g, dtype=torch.int64).to(dtype) \
        if dtype != torch.uint8 else torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


# format: (method factory, quant name, leaves {leaf: (gate/up shape, down shape, dtype)})
FORMATS = {
    "int8": (fake.W8A8Int8MoEMethod, "w8a8_int8",
             {"weight": ((N, H), (H, N), torch.int8), "weight_scale": ((N, 1), (H, 1), None)}),
    "fp8_block": (lambda: fake.Fp8MoEMethod((8, 8)), "fp8",
                  {"weight": ((N, H), (H, N), F8),
                   "weight_scale_inv": ((N // 8, H // 8), (H // 8, N // 8), None)}),
    "fp8_tensor": (fake.Fp8MoEMethod, "fp8",
                   {"weight": ((N, H), (H, N), F8), "weight_scale": ((), (), None)}),
    "nvfp4": (fake.ModelOptNvFp4FusedMoEMethod, "modelopt_fp4",
              {"weight": ((N, H // 2), (H, N // 2), torch.uint8),
               "weight_scale": ((N, H // 16), (H, N // 16), F8),
               "weight_scale_2": ((), (), None), "input_scale": ((), (), "one")}),
    "w4a16": (fake.CompressedTensorsFusedMoEMethod, "compressed-tensors",
              {"weight_packed": ((N, H // 8), (H, N // 8), torch.int32),
               "weight_scale": ((N, H // 8), (H, N // 8), torch.bfloat16),
               "weight_shape": ((2,), (2,), torch.int64)}),
}


def make_moe(fmt, tp=(1, 0), **kw):
    method, qname, _ = FORMATS[fmt]
    scheme = fake.CompressedTensorsWNA16MoE() if fmt == "w4a16" else None
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # SGLang builds the model under its dtype
    try:
        return fake.FusedMoE(method(), E, H, N, tp=tp, quant_name=qname, scheme=scheme, **kw)
    finally:
        torch.set_default_dtype(old)


def stream(fmt, seed=0, experts=range(E)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for e in experts:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for leaf, (gu, down, dt) in FORMATS[fmt][2].items():
                shape = down if proj == "down_proj" else gu
                t = torch.ones(()) if dt == "one" else _rand(shape, dt or torch.float32, g)
                out.append((f"{PRE}.{e}.{proj}.{leaf}", t))
    return out


class Qwen3MoeForCausalLM(nn.Module):  # the SGLang class name expert_loads.MODELS lists
    def __init__(self, moe):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = nn.Module()
        self.model.layers[0].mlp.experts = moe

    def load_weights(self, weights):  # make_expert_params_mapping's scan, per tensor
        params = dict(self.named_parameters())
        for name, t in weights:
            e, proj, leaf = name.removeprefix(PRE + ".").split(".")
            prefix, shard = {"gate_proj": ("w13_", "w1"), "up_proj": ("w13_", "w3"),
                             "down_proj": ("w2_", "w2")}[proj]
            pname = f"{PRE}.{prefix}{leaf}"
            if pname in params:
                params[pname].weight_loader(params[pname], t, pname, shard_id=shard,
                                            expert_id=int(e))


def init_params(moe, seed=7):
    g = torch.Generator().manual_seed(seed)
    for name, p in moe.named_parameters():
        if "input_scale" in name:
            p.data.fill_(1.0)
        else:
            b = p.data.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def count_calls(moe):
    """Per-tensor weight_loader calls and batched loads, per parameter (as inplace counts)."""
    calls, batched = {}, {}
    for name, p in moe.named_parameters():
        attr = "_weight_loader" if isinstance(p, fake.VParam) else "weight_loader"
        orig = getattr(p, attr)
        calls[name] = batched[name] = 0

        def counted(*a, _n=name, _o=orig, **k):
            calls[_n] += 1
            return _o(*a, **k)

        def add(n, _n=name):
            batched[_n] += n

        counted.__wrapped__, counted.qrl_add_loads = orig, add
        setattr(p, attr, counted)
    return calls, batched


def load_both(fmt, buckets, tp=(1, 0), **kw):
    """(reference, batched) modules after per-tensor and direct loads of the same buckets."""
    ref, got = make_moe(fmt, tp, **kw), make_moe(fmt, tp, **kw)
    init_params(ref)
    init_params(got)
    counts = count_calls(got)
    got.qrl_counts = {}  # load_experts_directly's counters, summed over the buckets
    for bucket in buckets:
        Qwen3MoeForCausalLM(ref).load_weights(bucket)
        model = Qwen3MoeForCausalLM(got)
        rest = expert_loads.load_experts_directly(model, dict(model.named_modules()), bucket,
                                                  got.qrl_counts)
        assert rest == []
    return ref, got, counts


def assert_same(ref, got):
    for (name, a), (_, b) in zip(ref.named_parameters(), got.named_parameters(), strict=True):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), name


@pytest.fixture(autouse=True)
def no_metadata(monkeypatch):
    monkeypatch.setattr(fake, "META", None)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("tp", [(1, 0), (2, 0), (2, 1)])
def test_batched_loads_are_bit_identical_to_per_tensor_loads(fmt, tp):
    ref, got, (calls, batched) = load_both(fmt, [stream(fmt)], tp)
    assert_same(ref, got)
    assert sum(calls.values()) == 0  # everything batched
    assert got.qrl_counts["experts_batched"] == got.qrl_counts["experts"] == sum(batched.values())
    n_leaves = len(FORMATS[fmt][2])
    assert sum(batched.values()) == 3 * E * n_leaves  # one counted load per tensor
    assert all(batched[p] == (2 * E if p.startswith("w13_") else E) for p in batched
               if batched[p])


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_up_first_and_non_gated_and_expert_maps(fmt, monkeypatch):
    ref, got, _ = load_both(fmt, [stream(fmt)], ep=(2, 1))  # experts 0, 1 not on this rank
    assert_same(ref, got)
    monkeypatch.setattr(fake._Method, "up_first", True)
    ref, got, (calls, _) = load_both(fmt, [stream(fmt)], tp=(2, 1))
    assert_same(ref, got)
    assert sum(calls.values()) == 0
    # expert-location metadata: logical 0 also on physical slot 3 (later overwritten by
    # expert 3 in stream order), global input scales on every physical copy
    monkeypatch.setattr(fake, "META", fake.Metadata(E, E, {0: [3], 1: [2]}))
    ref, got, (calls, _) = load_both(fmt, [stream(fmt)], tp=(2, 0))
    assert_same(ref, got)
    assert sum(calls.values()) == 0


def test_non_gated_w13_per_tensor_scales_keep_the_last_write():
    """Non-gated: w1 and w3 both write ``w13_weight_scale[e]`` whole (up's value stays), and
    both fill the leading rows of the 2I-row w13 buffer (a padded copy: not batched)."""
    ref, got, (calls, _) = load_both("fp8_tensor", [stream("fp8_tensor")], gated=False)
    assert_same(ref, got)
    assert {p for p, n in calls.items() if n} == {"w13_weight"}


def test_buckets_split_experts_out_of_order():
    order = [3, 0, 2, 1]
    full = {n: t for n, t in stream("nvfp4")}
    names = [n for e in order for n in full if f".{e}." in n]
    # cut mid-expert too: 5 tensors per bucket, 12 per expert
    buckets = [[(n, full[n]) for n in names[i:i + 5]] for i in range(0, len(names), 5)]
    for tp in [(1, 0), (2, 1)]:
        ref, got, (calls, _) = load_both("nvfp4", buckets, tp)
        assert_same(ref, got)
        assert sum(calls.values()) == 0


@pytest.mark.parametrize("case", ["method", "flag", "subclass", "input_scale_check"])
def test_unsupported_groups_fall_back_to_per_tensor_loads(case, monkeypatch):
    fmt, kw = "int8", {}
    if case == "method":
        monkeypatch.setitem(FORMATS, "bf16", (fake.UnquantizedFusedMoEMethod, None, {
            "weight": ((N, H), (H, N), torch.bfloat16)}))
        fmt = "bf16"
    elif case == "flag":
        kw = {"use_presharded_weights": True}
    elif case == "subclass":
        class EPMoE(fake.FusedMoE):  # a subclass overriding a reproduced method
            def _load_w13(self, *a):
                return super()._load_w13(*a)

        monkeypatch.setattr(fake, "FusedMoE", EPMoE)
    else:
        fmt = "nvfp4"
        monkeypatch.setitem(FORMATS, "nvfp4", (*FORMATS["nvfp4"][:1], "modelopt_w4afp8",
                                               FORMATS["nvfp4"][2]))
    ref, got, (calls, batched) = load_both(fmt, [stream(fmt)], **kw)
    assert_same(ref, got)
    assert got.qrl_counts == {"experts": 3 * E * len(FORMATS[fmt][2]),
                              "experts_batched": sum(batched.values())}
    if case == "input_scale_check":  # only the input scales: their check reads the parameter
        assert {p for p, n in calls.items() if n} == {"w13_input_scale", "w2_input_scale"}
        assert sum(calls.values()) == 3 * E and sum(batched.values()) == 3 * E * 3
    else:
        assert sum(calls.values()) == 3 * E * len(FORMATS[fmt][2])
        assert sum(batched.values()) == 0


@pytest.mark.parametrize("fmt", ["int8", "nvfp4", "w4a16"])
def test_inplace_sync_with_batched_direct_loads_equals_per_tensor_sync(fmt, tmp_path,
                                                                     monkeypatch):
    """Through load_packed: the shard-load check counts the batched loads, and the result
    equals an in-place sync through model.load_weights; the phase log counts the loads."""
    from megatron_qrl.rollout_sglang.sync.debug import PROFILE_ENV, summarize

    def sync(direct):
        moe = make_moe(fmt, (2, 1))
        init_params(moe)
        model = Qwen3MoeForCausalLM(moe)
        tracker = StreamTracker(tuple(FORMATS[fmt][2]), direct_experts=direct)
        items = stream(fmt, seed=3)
        for i in range(0, len(items), 7):
            bucket = []
            for n, t in items[i:i + 7]:
                tracker.add(n)
                bucket.append((n, tracker.send_as(n, t)))
            final = i + 7 >= len(items)
            load_packed(model, bucket + [("__qrl_inplace__", tracker.control(final))])
        return moe

    plain = sync(False)
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "phases.jsonl"))
    assert_same(plain, sync(True))
    (row,) = summarize(tmp_path / "phases.jsonl")
    assert row["experts"] == row["experts_batched"] == row["tensors"] == len(stream(fmt))
