"""The stacked experts (``--qrl-train-moe-experts stacked``) equal megatron-core's sequential ones.

Both models are the local spec (SDPA attention, no Transformer Engine) of the tiny Qwen3-MoE,
loaded with the same HF weights; the only difference is the experts: ``StackedGroupedMLP`` (one
``[experts, out, in]`` parameter per linear, one ``torch._grouped_mm`` per linear and forward)
against ``SequentialMLP`` (one linear per expert). Logits, loss and every gradient (under HF
names) agree for the plain forward, for the aligned forward of every weight format and with
routing replay; checkpoints and the HF streaming keep the per-expert names. fp32 on the CPU:
``torch._grouped_mm`` computes the same products as one matmul per expert.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers.te_quant_fixtures import FLIP_BATCH, grads_as_hf, hf_state, ids, tiny_hf

FORMATS = ("int8", "fp8", "fp8_block", "w4a16", "nvfp4")


def _model(arch, tensors, stacked, fmt=None, replay=None, layout=None, groups=None,
           **overrides):
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.stacked_experts import stacked_experts_spec_hook
    from megatron_qrl.models.streaming import load_hf_weights
    from megatron_qrl.moe import replay_spec_hook
    from megatron_qrl.te_quant import AlignedForwardState, aligned_spec_hook, compose_hooks

    state = AlignedForwardState(fmt) if fmt else None
    hook = compose_hooks(stacked_experts_spec_hook if stacked else None,
                         state and aligned_spec_hook(state), replay and replay_spec_hook(replay))
    model = build_model(arch, layout, spec_hook=hook, use_te=False,
                        use_cpu_initialization=True, **overrides)
    load_hf_weights(model, arch, tensors.__getitem__, groups)
    return state, model


def _run(model, arch, x, state=None, plain=False):
    """(logits, loss, HF-named gradients) of one forward + backward."""
    model.zero_grad()
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    with state.only(()) if plain else contextlib.nullcontext():
        logits = model(x, pos, attention_mask=None).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 torch.roll(x, -1, dims=1).flatten())
        loss.backward()
    return logits.detach(), loss.detach(), grads_as_hf(model, arch)


def _assert_same(got, want, what, tol=1e-6):
    (lg, ls, gg), (lw, lsw, gw) = got, want
    assert (lg - lw).abs().max().item() <= 10 * tol, what
    assert abs(ls.item() - lsw.item()) <= tol, what
    assert sorted(gg) == sorted(gw), what
    worst = max(((gg[k] - gw[k]).abs().max().item(), k) for k in gw)
    assert worst[0] <= tol, (what, worst)


@pytest.fixture(scope="module")
def tiny(megatron):
    hf, arch = tiny_hf("moe")
    return arch, hf_state(hf)


@pytest.fixture(scope="module")
def pair(tiny):
    arch, tensors = tiny
    return arch, _model(arch, tensors, True, "int8"), _model(arch, tensors, False, "int8")


def test_stacked_holds_two_expert_parameters_per_layer(tiny):
    from megatron_qrl.models.stacked_experts import StackedGroupedMLP

    arch, tensors = tiny
    _, model = _model(arch, tensors, True)
    experts = model.decoder.layers[0].mlp.experts
    assert isinstance(experts, StackedGroupedMLP)
    names = {n: tuple(p.shape) for n, p in experts.named_parameters()}
    f, h, e = arch.moe_ffn_hidden_size, arch.hidden_size, arch.num_experts
    assert names == {"linear_fc1.weight": (e, 2 * f, h), "linear_fc2.weight": (e, h, f)}


def test_stacked_equals_sequential_logits_loss_and_every_gradient(tiny):
    """Plain forward, EP 1: bit-level agreement (fp32, same products)."""
    arch, tensors = tiny
    x = ids(**FLIP_BATCH)
    got = _run(_model(arch, tensors, True)[1], arch, x)
    want = _run(_model(arch, tensors, False)[1], arch, x)
    _assert_same(got, want, "plain")


@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_aligned_forward_equals_sequential(pair, fmt):
    """The aligned forward (every weight format) on the stacked experts: the stacked cached
    ``Q_w`` with the straight-through gradient into the stack equals the per-expert path."""
    from megatron_qrl.quant import get_spec

    arch, (g_state, g_model), (s_state, s_model) = pair
    x = ids(**FLIP_BATCH)
    for state in (g_state, s_state):
        state.spec = get_spec(fmt)
        state.mark_weights_updated()
    got, want = _run(g_model, arch, x, g_state), _run(s_model, arch, x, s_state)
    _assert_same(got, want, fmt)
    unq = _run(s_model, arch, x, s_state, plain=True)  # the comparison is of a quantized forward
    assert (unq[0] - want[0]).abs().max().item() > 1e-3, fmt


def test_stacked_equals_sequential_with_routing_replay(tiny):
    """Replayed experts (mode ``all``) route every token of both paths to the given experts."""
    from megatron_qrl.moe import RoutingReplay

    arch, tensors = tiny
    x = ids(**FLIP_BATCH)
    route = torch.rand(x.numel(), arch.num_layers, arch.num_experts,
                       generator=torch.Generator().manual_seed(5)).argsort(-1)[..., :arch.moe_top_k]
    out = []
    for stacked in (True, False):
        replay = RoutingReplay("all", arch.num_experts, arch.moe_top_k)
        _, model = _model(arch, tensors, stacked, replay=replay)
        with replay.use(route, "update"):
            out.append(_run(model, arch, x))
        own = _run(model, arch, x)[0]
        assert (own - out[-1][0]).abs().max().item() > 1e-3, stacked
    _assert_same(out[0], out[1], "replay")


def test_hf_export_and_state_dict_keep_per_expert_names(tiny):
    """The HF stream of the stacked model is the sequential model's, tensor for tensor; its
    state dict holds ``linear_fc{1,2}.weight{i}`` and loads back (strict) into a fresh one."""
    from megatron_qrl.models.streaming import iter_hf_tensors

    arch, tensors = tiny
    _, stacked = _model(arch, tensors, True)
    _, seq = _model(arch, tensors, False)
    got, want = dict(iter_hf_tensors(stacked, arch)), dict(iter_hf_tensors(seq, arch))
    assert sorted(got) == sorted(want) == sorted(tensors)
    for k in want:
        assert torch.equal(got[k], want[k]) and torch.equal(got[k], tensors[k]), k
    sd = stacked.state_dict()
    prefix = "decoder.layers.1.mlp.experts."
    keys = sorted(k for k in sd if k.startswith(prefix) and "weight" in k)
    assert keys == sorted(f"{prefix}linear_fc{j}.weight{i}" for j in (1, 2)
                          for i in range(arch.num_experts))
    assert torch.equal(sd[f"{prefix}linear_fc2.weight3"],
                       tensors["model.layers.1.mlp.experts.3.down_proj.weight"])
    _, fresh = _model(arch, {k: torch.zeros_like(v) for k, v in tensors.items()}, True)
    fresh.load_state_dict(sd, strict=True)
    again = dict(iter_hf_tensors(fresh, arch))
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("stacked", [False, True])
def test_hf_stream_as_views_of_the_parameters(tiny, stacked):
    """``iter_hf_tensors(copy=False)`` (the direct sync's stream): the same tensors, each a view
    of its parameter's memory except query / key / value (split out of the fused
    ``linear_qkv``); the default stream shares no memory with the model. Mutations caught:
    the clone kept for ``copy=False``; a single shard concatenated (a copy) before it goes."""
    from megatron_qrl.models.streaming import iter_hf_tensors

    arch, tensors = tiny
    _, model = _model(arch, tensors, stacked)
    spans = [(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
             for p in model.parameters()]

    def shares(t):
        at = t.untyped_storage().data_ptr()
        return any(lo <= at < lo + n for lo, n in spans)

    views, copies = list(iter_hf_tensors(model, arch, copy=False)), list(iter_hf_tensors(model, arch))
    assert [n for n, _ in views] == [n for n, _ in copies]
    for (name, v), (_, c) in zip(views, copies):
        assert torch.equal(v, c), name
        assert not shares(c), name
        assert shares(v) == (name.split(".")[-2] not in ("q_proj", "k_proj", "v_proj")), name


def test_hf_stream_query_key_value_from_persistent_buffers(tiny):
    """``iter_hf_tensors(copy=False, buffers=d)``: the query / key / value come from ``d``'s
    buffers, the same memory in every stream, holding the current weights (the parameter
    changed between two streams); every other tensor is still a view of its parameter.
    Mutations caught: a fresh buffer per stream; the buffer left with the first stream's
    values."""
    from megatron_qrl.models.streaming import iter_hf_tensors

    arch, tensors = tiny
    _, model = _model(arch, tensors, False)
    buffers: dict = {}
    first = dict(iter_hf_tensors(model, arch, copy=False, buffers=buffers))
    qkv = [n for n in first if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")]
    assert sorted(buffers) == sorted(qkv) and qkv
    ptrs = {n: first[n].data_ptr() for n in first}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    second = dict(iter_hf_tensors(model, arch, copy=False, buffers=buffers))
    want = dict(iter_hf_tensors(model, arch))
    for n in want:
        assert torch.equal(second[n], want[n]), n
        assert second[n].data_ptr() == ptrs[n], n
    for n in qkv:
        assert second[n] is buffers[n]


def test_torch_dist_checkpoint_is_the_sequential_one(tiny, tmp_path):
    """A torch_dist checkpoint of the stacked model loads into the sequential model (and the
    other way round): the sharded keys are per global expert on both."""
    from megatron_qrl.models.checkpoint import load_checkpoint, save_checkpoint
    from megatron_qrl.models.streaming import iter_hf_tensors

    arch, tensors = tiny
    zeros = {k: torch.zeros_like(v) for k, v in tensors.items()}
    for src, dst in ((True, False), (False, True)):
        out = tmp_path / f"from_{'stacked' if src else 'sequential'}"
        (out / "hf").mkdir(parents=True)
        save_checkpoint(_model(arch, tensors, src)[1], out, {"architecture": arch.architecture})
        _, model = _model(arch, zeros, dst)
        load_checkpoint(model, out)
        got = dict(iter_hf_tensors(model, arch))
        assert all(torch.equal(got[k], tensors[k]) for k in tensors), (src, dst)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [0, 6, 0, 0]])
def test_stacked_linear_is_one_grouped_gemm_with_empty_experts(tiny, counts):
    """One linear: one grouped GEMM call in the forward; outputs and the gradients of the
    input and of every expert's slice equal one matmul per expert (0-token experts: zero)."""
    from types import SimpleNamespace

    from megatron.core.transformer import TransformerConfig

    from megatron_qrl.models.stacked_experts import StackedRowGroupedLinear
    from tests.te_quant.test_te_grouped import _CountGemms

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1,
                            use_cpu_initialization=True, num_moe_experts=4)
    pgs = SimpleNamespace(expt_tp=None, ep=None, expt_dp=None)
    fc2 = StackedRowGroupedLinear(4, 12, 8, config=cfg, init_method=torch.nn.init.normal_,
                                  bias=False, skip_bias_add=True, is_expert=True,
                                  pg_collection=pgs)
    x = torch.randn(sum(counts), 12, requires_grad=True)
    with _CountGemms() as mode:
        y, _ = fc2(x, counts)
    assert len(mode.calls) == 1, mode.calls
    dy = torch.randn(y.shape)
    y.backward(dy)
    w = fc2.weight.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    ref = torch.cat([xe @ w[e].t() for e, xe in enumerate(torch.split(xr, counts))])
    ref.backward(dy)
    assert torch.allclose(y, ref, atol=1e-6)
    assert torch.allclose(fc2.weight.grad, w.grad, atol=1e-6)
    assert torch.allclose(x.grad, xr.grad, atol=1e-6)
    for e, c in enumerate(counts):
        if c == 0:
            assert not fc2.weight.grad[e].any()


def test_stacked_flag_and_its_refusals(tiny):
    """``--qrl-train-moe-experts stacked`` builds the stacked experts through the trainer's
    forward plan; LoRA, a dense model and a TE recipe are one error each naming the flag."""
    from megatron_qrl.config import QrlArgumentError
    from megatron_qrl.config.run import RoutingReplayConfig, TrainForwardConfig
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.te_quant import trainer_forward

    configs, _, _ = parse_configs(["--qrl-preset", "tiny-cpu", "--qrl-train-moe-experts",
                                   "stacked"])
    assert configs["train"].moe_experts == "stacked"
    with pytest.raises(QrlArgumentError, match="--qrl-train-moe-experts stacked with "
                       "--qrl-lora-rank"):
        parse_configs(["--qrl-preset", "tiny-cpu", "--qrl-train-moe-experts", "stacked",
                       "--qrl-lora-rank", "4", "--qrl-train-forward", "bf16"])
    with pytest.raises(ValueError, match="--qrl-train-moe-experts must be one of"):
        TrainForwardConfig(moe_experts="grouped")
    arch, tensors = tiny
    with pytest.raises(ValueError, match="--moe-grouped-gemm needs the Transformer Engine spec.*"
                       "--qrl-train-moe-experts stacked"):
        _model(arch, tensors, False, moe_grouped_gemm=True)  # SequentialMLP: refused
    _model(arch, tensors, True, moe_grouped_gemm=True)  # the stacked experts are grouped
    with pytest.raises(ValueError, match="experts without bias only.*"
                       "--qrl-train-moe-experts megatron for biased"):  # a real choice
        _model(arch, tensors, True, add_bias_linear=True)
    off = RoutingReplayConfig("off")
    _, dense = tiny_hf("dense")
    with pytest.raises(ValueError, match="stacked needs an MoE model"):
        trainer_forward(TrainForwardConfig(moe_experts="stacked"), "int8", off, dense)
    with pytest.raises(ValueError, match="outside a Transformer Engine recipe"):
        trainer_forward(TrainForwardConfig("aligned", moe_experts="stacked"), "fp8", off, arch,
                        te_recipe="approximate")


def _ep2_body(rank, world_size, port, arch, tensors, x, save_dir):
    """EP 2 (gloo): logits, loss and every gradient (gathered to HF names over EP) of the
    stacked and the sequential experts; the stacked model saved as a torch_dist checkpoint."""
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.checkpoint import save_checkpoint
    from megatron_qrl.models.streaming import groups_from_parallel_state, iter_hf_tensors

    init_cpu_distributed(rank, world_size, port, tp=1, ep=2, etp=1)
    out = {}
    try:
        with cpu_device_mode():
            groups = groups_from_parallel_state()
            for stacked in (True, False):
                _, model = _model(arch, tensors, stacked, layout=ParallelLayout(ep=2),
                                  groups=groups)
                experts = model.decoder.layers[0].mlp.experts
                n_local = sum(p.shape[0] if p.dim() == 3 else 1
                              for n, p in experts.named_parameters() if "fc2" in n)
                logits, loss, _ = _run(model, arch, x)
                for _, p in model.named_parameters():
                    p.data = p.grad
                out[stacked] = (logits, loss, dict(iter_hf_tensors(model, arch, groups)), n_local)
                if stacked:
                    _, model = _model(arch, tensors, True, layout=ParallelLayout(ep=2),
                                      groups=groups)
                    save_checkpoint(model, save_dir, {"architecture": arch.architecture})
    finally:
        destroy_cpu_distributed()
    return out


def test_stacked_equals_sequential_at_ep2_and_its_checkpoint_loads_at_ep1(tiny, tmp_path):
    """Two expert-parallel ranks, each stacking its 4 local experts: same logits, loss and
    gradients as the sequential experts at EP 2; the EP-2 checkpoint of the stacked model
    loads into the sequential model at EP 1 with every HF tensor equal."""
    from megatron_qrl.models.checkpoint import load_checkpoint
    from megatron_qrl.models.streaming import iter_hf_tensors
    from tests.helpers.mp_utils import run_distributed

    arch, tensors = tiny
    (tmp_path / "hf").mkdir()
    x = ids(**FLIP_BATCH)
    results = run_distributed(_ep2_body, 2, arch, tensors, x, str(tmp_path))
    for rank, out in enumerate(results):
        assert out[True][3] == out[False][3] == arch.num_experts // 2, rank
        _assert_same(out[True][:3], out[False][:3], f"ep2 rank {rank}")
    _, model = _model(arch, {k: torch.zeros_like(v) for k, v in tensors.items()}, False)
    load_checkpoint(model, tmp_path)
    got = dict(iter_hf_tensors(model, arch))
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
