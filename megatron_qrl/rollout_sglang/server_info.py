"""What an SGLang engine reports about itself (``Engine.get_server_info()``), read into our
types. Pure: the dictionary in, no engine needed.

SGLang 0.5.17 returns the server arguments, the first scheduler's start-up info
(``max_total_num_tokens``: the KV pool's token positions) and ``internal_states`` (one per
data-parallel scheduler: ``effective_max_running_requests_per_dp``, the batch limit the
scheduler settled on, which the server argument ``max_running_requests`` only caps).
"""

from __future__ import annotations

from typing import Any

from ..rollout.capacity import EngineCapacity

__all__ = ["capacity_from_server_info"]


def capacity_from_server_info(info: dict[str, Any]) -> EngineCapacity | None:
    """The engine's :class:`EngineCapacity`; None when ``info`` lacks the KV pool size (an
    SGLang version that reports it elsewhere)."""
    tokens = info.get("max_total_num_tokens")
    states = info.get("internal_states") or [{}]
    running = (states[0] or {}).get("effective_max_running_requests_per_dp") \
        or info.get("max_running_requests")
    if not tokens or not running:
        return None
    return EngineCapacity(max_running_requests=int(running), kv_pool_tokens=int(tokens))
