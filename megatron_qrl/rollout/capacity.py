"""How many samples an engine decodes at once, and in how many waves a rollout's samples run.

An engine admits up to ``max_running_requests`` requests, and only as many as its KV pool
(``kv_pool_tokens``, every layer's cache for that many token positions) holds; the rest wait
and decode in later waves. A rollout that decodes in waves takes about ``waves`` times the
time of one batch: the engine's memory fraction (or the trainer's resident state beside it)
is then what bounds the rollout, not the kernels.

:func:`decode_waves` is a lower bound on the waves realised: a request holds the KV positions
of its prompt and of every token it generated until it ends, and the engine admits requests
while the pool has room. :func:`capacity_record` is what each rollout's metrics record carries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EngineCapacity", "capacity_record", "decode_waves"]


@dataclass(frozen=True)
class EngineCapacity:
    """What one engine holds at once."""

    max_running_requests: int
    """Requests decoded side by side (the engine's batch limit)."""
    kv_pool_tokens: int
    """Token positions the KV cache pool holds (all requests together)."""

    def at_once(self, tokens_per_sample: int) -> int:
        """Samples of ``tokens_per_sample`` positions each (prompt + response) that fit at once."""
        return max(1, min(self.max_running_requests,
                          self.kv_pool_tokens // max(tokens_per_sample, 1)))

    def describe(self, samples: int, tokens_per_sample: int) -> str:
        """One line: the engine's limits and the waves of ``samples`` samples of up to
        ``tokens_per_sample`` positions each."""
        fit = self.at_once(tokens_per_sample)
        waves = math.ceil(samples / fit)
        how = ("all decode at once" if waves == 1 else
               f"they decode in {waves} waves (raise the engine's memory fraction or free the "
               "trainer's memory during rollout to decode them together)")
        return (f"engine capacity: up to {self.max_running_requests:,} requests at once, KV pool "
                f"{self.kv_pool_tokens:,} tokens = {fit:,} samples of up to "
                f"{tokens_per_sample:,} tokens; {samples:,} samples per rollout: {how}")


def decode_waves(capacity: EngineCapacity, sample_tokens: Sequence[int]) -> int:
    """Lower bound on the waves in which samples of ``sample_tokens`` positions each (prompt +
    response, as generated) were decoded: the requests over the batch limit, and the positions
    over the KV pool, wait (module docstring)."""
    if not sample_tokens:
        return 0
    by_requests = math.ceil(len(sample_tokens) / max(capacity.max_running_requests, 1))
    by_tokens = math.ceil(sum(sample_tokens) / max(capacity.kv_pool_tokens, 1))
    return max(by_requests, by_tokens, 1)


def capacity_record(capacity: EngineCapacity | None, sample_tokens: Sequence[int]) -> dict[str, int]:
    """A rollout's metrics fields: the engine's batch limit (``engine_max_running_requests``),
    its KV pool (``engine_kv_pool_tokens``) and the waves its samples of ``sample_tokens``
    positions each decoded in (``rollout_waves``, :func:`decode_waves`); empty when the engine
    reports no capacity."""
    if capacity is None:
        return {}
    return {"engine_max_running_requests": capacity.max_running_requests,
            "engine_kv_pool_tokens": capacity.kv_pool_tokens,
            "rollout_waves": decode_waves(capacity, sample_tokens)}
