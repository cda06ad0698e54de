"""The built configs of one job, typed: :class:`QrlConfigs`.

:func:`~megatron_qrl.config.validate_qrl_args` returns one (a field per config group of
:func:`~megatron_qrl.config.default_config_classes`); ``qrl-train`` adds ``megatron`` (the
Megatron flags after ``--``) and ``job`` (the launcher's :class:`~.job.JobConfig`). Code
reads the fields (``configs.run.steps``); the mapping view (``configs["run"]``,
``configs.get("loss")``, ``"lora" in configs``) serves callers written against the dict of
earlier versions and config groups of another class under the same key (a test's stand-in).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    from ..losses import ErrorTokenConfig, PolicyLossConfig
    from ..models.lora_config import LoraConfig
    from ..quant.aqn import AQNConfig
    from .job import JobConfig
    from .launch import LaunchConfig
    from .megatron_flags import MegatronSettings
    from .run import (
        RolloutConfig,
        RoutingReplayConfig,
        RunConfig,
        TaskConfig,
        TrainForwardConfig,
        UAQConfig,
    )

__all__ = ["QrlConfigs"]


@dataclass
class QrlConfigs(Mapping):
    """Every config group of one job (module docstring); a group a job does not have is
    None (and absent from the mapping view)."""

    run: RunConfig = None  # type: ignore[assignment]
    rollout: RolloutConfig = None  # type: ignore[assignment]
    train: TrainForwardConfig = None  # type: ignore[assignment]
    routing: RoutingReplayConfig = None  # type: ignore[assignment]
    loss: PolicyLossConfig | None = None
    error_tokens: ErrorTokenConfig | None = None
    uaq: UAQConfig = None  # type: ignore[assignment]
    aqn: AQNConfig | None = None
    lora: LoraConfig = None  # type: ignore[assignment]
    task: TaskConfig = None  # type: ignore[assignment]
    launch: LaunchConfig = None  # type: ignore[assignment]
    megatron: MegatronSettings = None  # type: ignore[assignment]
    """``qrl-train``: the Megatron flags after ``--``."""
    job: JobConfig = None  # type: ignore[assignment]
    """``qrl-train``: ``--qrl-mode`` / ``--qrl-compare`` / ``--qrl-seeds``."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Config groups under other keys (a caller's own :class:`~.generator.ConfigGroup`),
    reached through the mapping view only."""

    @classmethod
    def of(cls, groups: Mapping[str, Any]) -> QrlConfigs:
        """``groups`` (``{group key: config}``) as one object."""
        if isinstance(groups, QrlConfigs):
            return groups
        known = {k: v for k, v in groups.items() if k in _names()}
        return cls(**known, extra={k: v for k, v in groups.items() if k not in known})

    # ---- the mapping view ------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key) if key in _names() else self.extra.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _names():
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __iter__(self) -> Iterator[str]:
        known = [n for n in _GROUPS if getattr(self, n) is not None]
        return iter(known + list(self.extra))

    def __len__(self) -> int:
        return sum(1 for _ in self)


_GROUPS = ("run", "rollout", "train", "routing", "loss", "error_tokens", "uaq", "aqn", "lora",
           "task", "launch", "megatron", "job")
"""The typed groups, in field order (``extra`` is not one)."""


def _names() -> set[str]:
    return set(_GROUPS)
