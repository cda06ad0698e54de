"""``--qrl-*`` flags for Megatron RL runs: generate, build, validate.

Usable as Megatron's ``extra_args_provider``::

    from megatron.training.arguments import parse_args
    from megatron_qrl.config import add_qrl_args, validate_qrl_args
    args = parse_args(extra_args_provider=add_qrl_args)
    configs = validate_qrl_args(args)      # QrlConfigs: configs.run, configs.rollout, ...

All flags live in one argument group titled ``megatron_qrl`` and start with ``--qrl-``. The
flag set is generated from :func:`default_config_classes` (see ``generator``).
"""

from __future__ import annotations

import argparse
import inspect
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from ..losses import ErrorTokenConfig, PolicyLossConfig
from ..models.lora_config import LoraConfig, base_format_choices
from ..quant.aqn import AQNConfig
from ..utils.devices import gpu_capability as _gpu_capability
from .checkpoint_info import read_checkpoint_info
from .checks import CheckEnv, combination_problems, combination_warnings
from .configs import QrlConfigs
from .generator import ConfigGroup, FlagSpec, add_group_args, explicit_dests, specs_by_flag
from .launch import LaunchConfig
from .presets import PRESETS, preset_names
from .run import (
    RolloutConfig,
    RoutingReplayConfig,
    RunConfig,
    TaskConfig,
    TrainForwardConfig,
    UAQConfig,
)

__all__ = [
    "GROUP_TITLE",
    "QrlArgumentError",
    "add_qrl_args",
    "default_config_classes",
    "effective_values",
    "qrl_configs_from_args",
    "validate_qrl_args",
]

GROUP_TITLE = "megatron_qrl"

# (key, class, flag prefix, {field: constant of the class's module holding the field's
# choices}): the config classes of losses/, whose fields do not carry their choices.
LOSS_GROUPS: tuple[tuple[str, type, str, dict[str, str]], ...] = (
    ("loss", PolicyLossConfig, "loss",
     {"kind": "LOSS_KINDS", "tbpo_mask": "TBPO_MASK_RULES", "aggregation": "AGGREGATIONS"}),
    ("error_tokens", ErrorTokenConfig, "error-tokens", {"action": "ERROR_TOKEN_ACTIONS"}),
)
LOSS_DEFAULTS: dict[str, dict[str, object]] = {"loss": {"kind": "ppo_clip"}}
"""Command-line defaults of loss-group fields that have none in the dataclass."""


class QrlArgumentError(ValueError):
    """A ``--qrl-*`` value or combination is invalid; the message names the flags."""


def _loss_overrides(key: str, cls: type, choices: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Defaults and choices that a losses/ dataclass does not carry in its annotations."""
    home = inspect.getmodule(cls)
    over: dict[str, dict[str, Any]] = {f: {"default": v} for f, v in LOSS_DEFAULTS.get(key, {}).items()}
    for fname, const in choices.items():
        if hasattr(home, const):
            over.setdefault(fname, {})["choices"] = tuple(getattr(home, const))
    return over


def _loss_groups() -> list[ConfigGroup]:
    return [ConfigGroup(key, cls, prefix, _loss_overrides(key, cls, choices))
            for key, cls, prefix, choices in LOSS_GROUPS]


def default_config_classes() -> list[ConfigGroup]:
    """Every config group behind the ``--qrl-*`` flags, in help order.

    ``PolicyLossConfig`` (``--qrl-loss-*``) and ``ErrorTokenConfig`` (``--qrl-error-tokens-*``)
    come from ``megatron_qrl.losses``; the loss ``kind`` defaults to ``ppo_clip`` on the
    command line (the dataclass has no default).
    """
    return [
        ConfigGroup("run", RunConfig, ""),
        ConfigGroup("rollout", RolloutConfig, "rollout"),
        ConfigGroup("train", TrainForwardConfig, "train"),
        ConfigGroup("routing", RoutingReplayConfig, "routing"),
        *_loss_groups(),
        ConfigGroup("uaq", UAQConfig, "uaq"),
        ConfigGroup("aqn", AQNConfig, "aqn"),
        ConfigGroup("lora", LoraConfig, "lora",
                    {"base_format": {"choices": base_format_choices}}),
        ConfigGroup("task", TaskConfig, "task"),
        ConfigGroup("launch", LaunchConfig, "launch"),
    ]


def _missing_prefixes(groups: Sequence[ConfigGroup]) -> tuple[str, ...]:
    present = {g.key for g in groups}
    return tuple(f"--qrl-{g[2]}-" for g in LOSS_GROUPS if g[0] not in present)


def add_qrl_args(parser: argparse.ArgumentParser,
                 groups: Sequence[ConfigGroup] | None = None) -> argparse.ArgumentParser:
    """Add every ``--qrl-*`` flag to ``parser`` in one argument group; return ``parser``."""
    groups = default_config_classes() if groups is None else list(groups)
    specs_by_flag(groups)  # rejects a flag generated twice before touching the parser
    arg_group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="megatron_qrl: quantized rollouts for Megatron RL (flags from config "
                    "dataclasses; --qrl-preset applies named flag sets, user flags win)")
    for g in groups:
        add_group_args(arg_group, g)
    return parser


def effective_values(args: argparse.Namespace, groups: Sequence[ConfigGroup] | None = None,
                     presets: Mapping[str, Mapping[str, Any]] = PRESETS) -> dict[str, Any]:
    """``{dest: value}`` of every ``--qrl-*`` flag after presets (user flags win)."""
    groups = default_config_classes() if groups is None else list(groups)
    specs = specs_by_flag(groups)
    missing = [s.flag for s in specs.values() if not hasattr(args, s.dest)]
    if missing:
        raise QrlArgumentError(f"args lack {', '.join(missing[:3])}...: parse them with a parser "
                               "that add_qrl_args(parser) extended")
    values = {s.dest: getattr(args, s.dest) for s in specs.values()}
    preset = values.get("qrl_preset")
    if not preset:
        return values
    explicit, skip = explicit_dests(args), _missing_prefixes(groups)
    try:
        names = preset_names(preset, presets)
    except ValueError as exc:
        raise QrlArgumentError(str(exc)) from None
    for name in names:
        for flag, value in presets[name].items():
            if flag in specs:
                if specs[flag].dest not in explicit:
                    values[specs[flag].dest] = value
            elif not (skip and flag.startswith(skip)):
                raise QrlArgumentError(f"--qrl-preset {name} sets {flag}, which no config "
                                       "group generates (fix megatron_qrl/config/presets.py)")
    return values


def _build(group: ConfigGroup, specs: Sequence[FlagSpec], values: Mapping[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}  # a dataclass field's own fields (generator)
    for s in specs:
        if values[s.dest] is None and s.default is None and not s.optional:
            raise QrlArgumentError(f"{s.flag} is required ({s.help})")
        head, dot, rest = s.field.partition(".")
        if dot:
            nested.setdefault(head, {})[rest] = values[s.dest]
        else:
            kwargs[s.field] = values[s.dest]
    try:
        hints = typing.get_type_hints(group.cls) if nested else {}
        kwargs |= {head: hints[head](**sub) for head, sub in nested.items()}
        return group.cls(**kwargs)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        if "--qrl-" not in text:
            stem = f"--qrl-{group.prefix}-*" if group.prefix else "--qrl-*"
            text = f"{stem} ({group.cls.__name__}): {text}"
        raise QrlArgumentError(text) from None


def qrl_configs_from_args(args: argparse.Namespace,
                          groups: Sequence[ConfigGroup] | None = None) -> QrlConfigs:
    """The :class:`~.configs.QrlConfigs` (``{group key: dataclass instance}``) of parsed args
    (presets applied, fields checked)."""
    groups = default_config_classes() if groups is None else list(groups)
    values = effective_values(args, groups)
    specs = specs_by_flag(groups).values()
    return QrlConfigs.of({g.key: _build(g, [s for s in specs if s.group == g.key], values)
                          for g in groups})


def _check_env(configs: Mapping[str, Any], gpu_capability: Any, checkpoint_metadata: Any,
               model_config: Any) -> CheckEnv:
    run = configs["run"]
    if run.model == "checkpoint" and (checkpoint_metadata is None or model_config is None):
        try:
            meta, cfg = read_checkpoint_info(run.checkpoint)
        except (OSError, ValueError) as exc:
            raise QrlArgumentError(str(exc)) from None
        checkpoint_metadata = meta if checkpoint_metadata is None else checkpoint_metadata
        model_config = cfg if model_config is None else model_config
    if gpu_capability == "auto":
        gpu_capability = _gpu_capability()
    return CheckEnv(gpu_capability, checkpoint_metadata, model_config)


def validate_qrl_args(args: argparse.Namespace, *, groups: Sequence[ConfigGroup] | None = None,
                      gpu_capability: tuple[int, int] | None | str = "auto",
                      checkpoint_metadata: Mapping[str, Any] | None = None,
                      model_config: Mapping[str, Any] | None = None) -> QrlConfigs:
    """Build the configs, reject impossible combinations, write effective values to ``args``.

    Raises :class:`QrlArgumentError` with ONE message listing every problem, each naming its
    flags. ``gpu_capability`` defaults to the local GPU's; ``checkpoint_metadata`` and
    ``model_config`` default to what ``--qrl-checkpoint`` holds (with ``--qrl-model
    checkpoint``). Returns the :class:`~.configs.QrlConfigs` of the groups.
    """
    groups = default_config_classes() if groups is None else list(groups)
    configs = qrl_configs_from_args(args, groups)
    env = _check_env(configs, gpu_capability, checkpoint_metadata, model_config)
    problems = combination_problems(configs, env)
    if problems:
        raise QrlArgumentError("invalid --qrl-* flag combination:\n  - " + "\n  - ".join(problems))
    combination_warnings(configs)
    for dest, value in effective_values(args, groups).items():
        setattr(args, dest, value)
    return configs
