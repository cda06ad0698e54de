"""The weight transports' registry (megatron_qrl.sync.transport): every transport is named
once per side, the names are the flags' choices, and ``auto`` is resolved in one place per
side (``pick_transport`` for a Ray actor, ``SGLangOptions.sync_for`` for SGLang) to a
registered name. No Ray, no SGLang: importing the transports registers them."""

from __future__ import annotations

import ast
import itertools
import typing
from pathlib import Path

import pytest

import megatron_qrl.rollout.transports  # noqa: F401  (registers side ray / fleet)
import megatron_qrl.rollout_sglang.sync.transports  # noqa: F401  (registers side sglang)
from megatron_qrl.config.run import RunConfig
from megatron_qrl.quant import list_specs
from megatron_qrl.rollout.ray_actor import WEIGHT_TRANSPORTS, pick_transport
from megatron_qrl.rollout_sglang.options import SYNC_MODES, SGLangOptions
from megatron_qrl.sync.transport import (
    SIDES,
    WeightTransport,
    register_transport,
    transport_class,
    transport_names,
)

ROOT = Path(__file__).resolve().parents[2] / "megatron_qrl"


def test_each_transport_is_named_once_and_the_names_are_the_flags_choices():
    names = {side: transport_names(side) for side in SIDES}
    assert set(names["ray"]) == {"broadcast", "objectstore", "ipc"}
    assert set(names["fleet"]) == {"broadcast", "sharded"}
    assert set(names["sglang"]) == set(SYNC_MODES) == {"tensor", "inplace", "distributed",
                                                        "disk", "direct"}
    for side, side_names in names.items():
        assert len(side_names) == len(set(side_names)), side
        assert "auto" not in side_names
        classes = [transport_class(side, n, "--flag") for n in side_names]
        assert len(set(classes)) == len(classes)  # one class (one file) per transport
        for name, cls in zip(side_names, classes):
            assert issubclass(cls, WeightTransport) and (cls.side, cls.name) == (side, name)
    # one file per transport
    modules = [transport_class(s, n, "").__module__ for s in SIDES for n in names[s]]
    assert len(modules) == len(set(modules)), modules
    flag = typing.get_args(typing.get_type_hints(RunConfig)["ray_weight_transport"])
    assert set(flag) - {"auto"} == set(WEIGHT_TRANSPORTS) == set(names["ray"])


def test_a_second_registration_and_auto_are_refused():
    for side, name in [("ray", "broadcast"), ("sglang", "inplace"), ("fleet", "sharded"),
                       ("ray", "auto")]:
        with pytest.raises(ValueError, match="already registered"):
            register_transport(side, name)(type("Again", (WeightTransport,), {}))
    assert transport_names("ray") == WEIGHT_TRANSPORTS  # nothing was added
    with pytest.raises(ValueError, match="--qrl-ray-weight-transport 'nccl': choose one of"):
        transport_class("ray", "nccl", "--qrl-ray-weight-transport")


def test_auto_resolves_to_a_registered_transport():
    ray = set(transport_names("ray"))
    for colocated, shares, kind, nodes, sharded in itertools.product(
            (True, False), (True, False), ("reference", "sglang"), (1, 2), (True, False)):
        assert pick_transport("auto", colocated, shares, kind, nodes, sharded) in ray
    sglang = set(transport_names("sglang"))
    for fmt, lora in itertools.product(list_specs(), (False, True)):
        assert SGLangOptions().sync_for(fmt, lora=lora) in sglang


RESOLVERS = {("rollout/ray_actor.py", "pick_transport"), ("rollout_sglang/options.py", "sync_for")}
"""Where ``auto`` is resolved (a ``== "auto"`` / ``!= "auto"`` test)."""
NOT_RESOLVING = {("rollout_sglang/options.py", "problem"), ("rl/ray_modes.py", "announce"),
                 ("sync/transport.py", "register_transport"), ("sync/transport.py", "add")}
"""Where ``auto`` is only named in a message (what it resolved to is asked of a resolver)
or refused as a transport's name."""
SYNC_PACKAGES = ("sync", "rollout", "rollout_sglang", "rl", "config")


def _auto_tests() -> set[tuple[str, str]]:
    """``(file, enclosing function)`` of every equality test against ``"auto"`` in the
    packages of the weight sync and its flags."""
    found = set()
    for pkg in SYNC_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for func in ast.walk(tree):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(func):
                    if isinstance(node, ast.Compare) and any(
                            isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops) and any(
                            isinstance(c, ast.Constant) and c.value == "auto"
                            for c in [node.left, *node.comparators]):
                        found.add((str(path.relative_to(ROOT)), func.name))
    return found


def test_auto_is_resolved_in_one_place_per_side():
    other_autos = {"config/args.py",  # --qrl-gpu-capability auto: not a sync choice
                   "rl/trainer_sleep.py",  # --qrl-trainer-sleep auto: nor this
                   "rollout_sglang/attention.py"}  # --qrl-rollout-sglang-attention-backend auto
    sync_auto = {f for f in _auto_tests() if f[0] not in other_autos}
    assert sync_auto - NOT_RESOLVING == RESOLVERS
