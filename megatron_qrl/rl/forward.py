"""Which training forward the driver builds: plain, or rollout-aligned (QaRL) + routing replay.

``--qrl-train-forward aligned`` needs the spec provider of ``megatron_qrl.te_quant``
(``aligned_spec_hook(spec)``) and ``--qrl-routing-replay`` the replay context of
``megatron_qrl.moe`` (``replay_context(routed_experts)``). Both are looked up here, once;
when the installed megatron_qrl lacks them the run stops with an error naming the flag —
never a silent fallback to the plain forward.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ForwardPlan", "ForwardUnavailableError", "forward_plan"]


class ForwardUnavailableError(RuntimeError):
    """A requested training forward is not available in this megatron_qrl installation."""


@dataclass(frozen=True)
class ForwardPlan:
    """The spec hook for :func:`megatron_qrl.rl.trainer.build_policy` and the replay factories."""

    spec_hook: Callable | None = None
    recompute_replay: Callable | None = None
    """Replay context for the pi_prox recompute (``recompute`` and ``all``)."""
    update_replay: Callable | None = None
    """Replay context for the update forward (``all`` only)."""


def _lookup(module: str, name: str, flag: str) -> Callable:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ForwardUnavailableError(
            f"{flag} needs {module} ({exc}); it is not part of this megatron_qrl installation. "
            "Run without the flag (e.g. --qrl-train-forward bf16 / --qrl-routing-replay off) "
            "or update megatron_qrl") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise ForwardUnavailableError(f"{flag}: {module} has no {name}(); update megatron_qrl")
    return fn


def forward_plan(configs: dict[str, Any]) -> ForwardPlan:
    """Resolve ``--qrl-train-forward`` / ``--qrl-routing-replay`` into hooks (errors name the flag)."""
    train, routing, rollout = configs["train"], configs["routing"], configs["rollout"]
    hook = None
    if train.forward == "aligned":
        make = _lookup("megatron_qrl.te_quant", "aligned_spec_hook",
                       "--qrl-train-forward aligned")
        hook = make(rollout.spec)
    replay = None
    if routing.replay != "off":
        replay = _lookup("megatron_qrl.moe", "replay_context",
                         f"--qrl-routing-replay {routing.replay}")
    return ForwardPlan(spec_hook=hook, recompute_replay=replay,
                       update_replay=replay if routing.replay == "all" else None)
