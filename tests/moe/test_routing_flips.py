"""The routing-flip counter of the tests (tests/helpers/routing_flips.py) on real Megatron MoE models.

Two tiny local-spec Qwen3-MoE models on CPU, equal but for the last layer's router weight,
moved so that the nearest near-tie token of that layer changes its k-th expert (and whatever
other tokens the move carries across a tie). The expected flips come from the router's inputs
and both weights directly (top-k of ``h @ W^T`` in fp64), not from Megatron or the helper.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.routing_flips import (
    assert_few_flips,
    record_routing,
    routing_flips,
    routing_ids,
)
from tests.helpers.te_quant_fixtures import build, hf_state, ids, quiet_torch_trace, tiny_hf


def _sets(logits: torch.Tensor, k: int) -> list[set[int]]:
    return [set(row) for row in logits.topk(k, -1).indices.tolist()]


def _forward(model, x):
    pos = torch.arange(x.shape[1])[None].expand_as(x)
    with record_routing(model) as maps, torch.no_grad():
        model(x, pos, attention_mask=None)
    return maps


def test_routing_flips_counts_what_a_moved_router_weight_flips():
    from megatron_qrl.models.runtime import single_process_megatron

    hf, arch = tiny_hf("moe")
    tensors, x = hf_state(hf), ids(batch=2, seq=16)
    k, last = arch.moe_top_k, arch.num_layers - 1
    name = f"model.layers.{last}.mlp.gate.weight"
    with quiet_torch_trace(), single_process_megatron():
        a = build(arch, tensors)
        seen = []
        a.decoder.layers[last].mlp.router.register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].detach()) and None)
        ref = _forward(a, x)
        h = seen[0].reshape(-1, arch.hidden_size).double()  # token s * batch + b
        w = tensors[name].double()
        logits = h @ w.T
        own = _sets(logits, k)
        top = logits.topk(k + 1, -1)
        gap = top.values[:, k - 1] - top.values[:, k]
        t = int(gap.argmin())  # raise token t's (k+1)-th expert 0.05 above its k-th
        moved_w = w.clone()
        moved_w[top.indices[t, k]] += (gap[t] + 0.05) * h[t] / h[t].dot(h[t])
        b = build(arch, {**tensors, name: moved_w.float()})
        got = _forward(b, x)
    want = _sets(h @ moved_w.float().double().T, k)
    flipped = [i for i in range(len(own)) if want[i] != own[i]]
    experts = sorted({(last, e) for i in flipped for e in want[i] ^ own[i]})
    n = sum(len(want[i] - own[i]) for i in flipped)
    assert t in flipped and n >= 1
    # the recorded maps are the routers' top-k: the reference's equals the fp64 recomputation
    assert [set(r) for r in routing_ids(ref, k)[:, last].tolist()] == own
    assert [set(r) for r in routing_ids(got, k)[:, last].tolist()] == want
    found = routing_flips(got, ref)
    print(f"\nmoved router: {found}")
    assert found.flipped == n
    assert found.per_layer == (0,) * last + (n,)  # the layers before see the same inputs
    assert found.total == x.numel() * arch.num_layers * k
    assert found.experts == tuple(experts)
    assert found.tokens == tuple((last, i) for i in flipped)
    assert routing_flips(ref, ref).flipped == 0 and routing_flips(ref, ref).experts == ()
    assert_few_flips(got, ref, "moved router", max_fraction=n / found.total)
    with pytest.raises(AssertionError, match="moved router"):
        assert_few_flips(got, ref, "moved router", max_fraction=(n - 0.5) / found.total)
    assert_few_flips(got, ref, "moved router", max_fraction=0.0, baseline=found, factor=1.0)
    with pytest.raises(AssertionError, match=f"the {n} of the baseline"):
        assert_few_flips(got, ref, "moved router", max_fraction=0.0, baseline=found,
                         factor=(n - 0.5) / n)


def test_routing_flips_refuses_maps_of_other_tokens_or_layers():
    a = {0: torch.tensor([[True, False, True], [False, True, True]])}
    with pytest.raises(ValueError, match="record the same tokens"):
        routing_flips({0: a[0][:1]}, a)
    with pytest.raises(ValueError, match="MoE layers differ"):
        routing_flips({1: a[0]}, a)
    with pytest.raises(ValueError, match="expected 1 each"):
        routing_ids(a, 1)
    assert routing_ids(a, 2).tolist() == [[[0, 2]], [[1, 2]]]
