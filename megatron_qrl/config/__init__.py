"""``--qrl-*`` flags generated from config dataclasses, presets, and their validation.

>>> import argparse
>>> from megatron_qrl.config import add_qrl_args, validate_qrl_args
>>> parser = add_qrl_args(argparse.ArgumentParser(allow_abbrev=False))
>>> configs = validate_qrl_args(parser.parse_args(["--qrl-preset", "tiny-cpu"]))
"""

from .args import (
    GROUP_TITLE,
    QrlArgumentError,
    add_qrl_args,
    default_config_classes,
    effective_values,
    qrl_configs_from_args,
    validate_qrl_args,
)
from .checks import TBPO_AGGREGATIONS, prox_first_blocker, prox_from_first_update
from .configs import QrlConfigs
from .generator import ConfigGroup, field_docstrings, flag_specs
from .job import JobConfig, job_group
from .presets import PRESETS
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
    "PRESETS",
    "TBPO_AGGREGATIONS",
    "ConfigGroup",
    "JobConfig",
    "QrlArgumentError",
    "QrlConfigs",
    "RolloutConfig",
    "RoutingReplayConfig",
    "RunConfig",
    "TaskConfig",
    "TrainForwardConfig",
    "UAQConfig",
    "add_qrl_args",
    "default_config_classes",
    "effective_values",
    "field_docstrings",
    "flag_specs",
    "job_group",
    "prox_first_blocker",
    "prox_from_first_update",
    "qrl_configs_from_args",
    "validate_qrl_args",
]
