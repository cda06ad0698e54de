"""Next-token sampling: temperature, top-k, top-p (nucleus), greedy — pure functions."""

from __future__ import annotations

import hashlib

import torch

from .base import SamplingParams


def derive_seed(kind: str, base: int, k: int) -> int:
    """The ``k``-th seed of kind ``kind`` derived from seed ``base``: a hash, so neighbouring
    ``k`` and bases get unrelated streams; < 2**63 (an int64 for SGLang)."""
    digest = hashlib.blake2b(f"qrl-{kind}:{base}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def row_seeds(seed: int, n: int) -> list[int]:
    """One seed per row of a batch of ``n`` sampled with ``seed``, for an engine that seeds
    each request on its own (SGLang's per-request ``sampling_seed``: two requests with the
    same prompt and seed give the same sample, so a prompt group's rows need their own)."""
    return [derive_seed("row", seed, i) for i in range(n)]


def sample_next(logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; return (token ids [B], log-probs [B]).

    The log-prob is of the sampled token under ``softmax(logits / T)`` (``T`` = temperature)
    BEFORE top-k / top-p truncation — the behaviour-policy probability the off-policy
    corrections need; with temperature 0 (greedy) it is under ``softmax(logits)``.
    """
    if sampling.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
    filtered = logp.clone()
    if sampling.top_k > 0:
        kth = torch.topk(filtered, min(sampling.top_k, filtered.shape[-1]), dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_lp, order = torch.sort(filtered, dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop = cum - sorted_lp.exp() >= sampling.top_p  # keep the smallest set reaching top_p
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_lp)
    probs = torch.softmax(filtered, dim=-1)
    tok = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device) \
        if generator.device.type == "cpu" else torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
