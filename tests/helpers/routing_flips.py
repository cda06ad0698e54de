"""Routing flips: top-k expert choices of an MoE model that differ from a reference's (tests only).

Two models that compute the same router logits up to rounding (BF16 vs fp32, TE vs local
kernels, a fused vs unfused RoPE upstream) route a token differently wherever its k-th and
(k+1)-th logits lie within that rounding of each other: a flip. A flipped token goes through
another expert, so that expert's gradient and the token's output move by O(1) while every
other number stays at rounding noise. Whether a batch holds a flip is luck of the draw; tests
therefore COUNT the flips (:func:`routing_flips`), bound the count (:func:`assert_few_flips`),
and compare the continuous numerics with the routing pinned to the reference's
(:func:`routing_ids` feeds ``megatron_qrl.moe.RoutingReplay``) or only where it agrees
(:attr:`RoutingFlips.experts`).

Routing maps are megatron-core's: the router returns ``(probs, routing_map)`` with
``routing_map`` a bool ``[tokens, num_experts]`` (token ``s * batch + b``, the rank's tokens
only under sequence parallelism). This module counts without Megatron's help: set
differences of the recorded maps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@contextlib.contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block every forward of ``model`` stores each router's ``routing_map`` (bool
    ``[tokens, num_experts]``, on the CPU) under its MoE layer index (0-based, in module
    order = ``moe.replay``'s index for an all-MoE model); the last forward wins."""
    from megatron.core.transformer.moe.router import Router

    maps: dict[int, torch.Tensor] = {}
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not routers:
        raise ValueError("record_routing: the model has no MoE router")

    def hook(index: int):
        def store(_module, _args, out) -> None:
            maps[index] = out[1].detach().bool().cpu()
        return store

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        yield maps
    finally:
        for h in handles:
            h.remove()


def routing_ids(maps: dict[int, torch.Tensor], top_k: int) -> torch.Tensor:
    """Recorded maps as expert ids ``[tokens, layers, top_k]`` (ascending per token): the
    replay tensor of ``megatron_qrl.moe.RoutingReplay.use``."""
    out = []
    for layer in sorted(maps):
        m = maps[layer]
        per_token = m.sum(-1)
        if not bool((per_token == top_k).all()):
            raise ValueError(f"layer {layer}: tokens routed to {sorted(set(per_token.tolist()))} "
                             f"experts, expected {top_k} each (dropless top-k)")
        out.append(m.nonzero()[:, 1].reshape(-1, top_k))
    return torch.stack(out, dim=1)


@dataclass(frozen=True)
class RoutingFlips:
    """Token-routes of one model that a reference does not have."""

    flipped: int
    """Token-routes (token, layer, expert) chosen by the model but not by the reference."""
    total: int
    """The reference's token-routes: tokens x layers x top_k."""
    per_layer: tuple[int, ...]
    experts: tuple[tuple[int, int], ...]
    """(MoE layer, expert) whose routed token set differs: every expert a flip leaves or enters."""
    tokens: tuple[tuple[int, int], ...]
    """(MoE layer, token) of every flipped token."""

    @property
    def fraction(self) -> float:
        return self.flipped / max(self.total, 1)

    def __str__(self) -> str:
        return (f"{self.flipped} of {self.total} token-routes flipped ({self.fraction:.2%}; per "
                f"layer {list(self.per_layer)}); (layer, token) {list(self.tokens)}; (layer, "
                f"expert) with another token set {list(self.experts)}")


def routing_flips(got: dict[int, torch.Tensor], ref: dict[int, torch.Tensor]) -> RoutingFlips:
    """Count where the routing maps ``got`` differ from ``ref`` (both from :func:`record_routing`
    over the same tokens)."""
    if sorted(got) != sorted(ref):
        raise ValueError(f"MoE layers differ: {sorted(got)} vs reference {sorted(ref)}")
    per_layer, experts, tokens, total = [], [], [], 0
    for layer in sorted(ref):
        g, r = got[layer], ref[layer]
        if g.shape != r.shape:
            raise ValueError(f"layer {layer}: routing map {tuple(g.shape)} vs reference "
                             f"{tuple(r.shape)}: record the same tokens")
        new = g & ~r
        per_layer.append(int(new.sum()))
        total += int(r.sum())
        experts += [(layer, int(e)) for e in (g ^ r).any(0).nonzero().flatten()]
        tokens += [(layer, int(t)) for t in new.any(1).nonzero().flatten()]
    return RoutingFlips(sum(per_layer), total, tuple(per_layer), tuple(experts), tuple(tokens))


def assert_few_flips(got: dict[int, torch.Tensor], ref: dict[int, torch.Tensor], what: str,
                     max_fraction: float = 0.01, baseline: RoutingFlips | None = None,
                     factor: float = 3.0) -> RoutingFlips:
    """:func:`routing_flips`, asserting at most ``max_fraction`` of the token-routes flipped,
    plus ``factor`` x the flips of ``baseline`` (a trusted model at the same rounding level
    against the same reference, e.g. the local-spec BF16 model for a TE-spec BF16 one).

    How many near-ties a batch holds is luck: the local BF16 tiny MoE flips 0.5-1.8% of 1,024
    token-routes against fp32 over four token batches (CPU, 2026-12-01), so a fixed fraction
    alone is a lucky-seed bound; the baseline scales the bound with the batch. A wrong router
    input, dtype or top-k moves many more."""
    found = routing_flips(got, ref)
    allowed = max_fraction * found.total + (factor * baseline.flipped if baseline else 0.0)
    assert found.flipped <= allowed, (
        f"{what}: {found}; allowed {allowed:.1f} ({max_fraction:.1%} of the token-routes"
        + (f" + {factor:g} x the {baseline.flipped} of the baseline" if baseline else "")
        + "): rounding near-ties flip a few, a systematic difference before or in the router "
        "moves many")
    return found
