"""The weight sync splits where the process splits, at import time too.

SGLang's scheduler imports the in-place loader by name (``load_format`` =
:data:`megatron_qrl.sync.protocol.inplace.LOADER`); what that import loads runs in every
engine process. A fresh interpreter imports the module and reports which of the package's
modules got loaded: the loader must load none of the trainer's side (sender, transports, engine,
supervisor, the RL driver, the quantization registry), and the protocol both sides share
(and the transports' interface on it) nothing of the package but the one HF-name parser.
(The storage service loads the direct writer and the format registry only when an
engine-side write is asked for: sync.loader.storage_write.)
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_qrl.sync.protocol.engine_layout import STORAGE
from megatron_qrl.sync.protocol.inplace import LOADER

ROOT = Path(__file__).resolve().parents[2]
PARSER = "megatron_qrl.utils.hf_names"
KERNEL_CHOICE = "megatron_qrl.utils.kernel_choice"  # the fingerprints' auto/torch/triton switch
TRAINER_SIDE = ("megatron_qrl.rollout_sglang.sync.sender", "megatron_qrl.rollout_sglang.engine",
                "megatron_qrl.rollout_sglang.sync.transports",
                "megatron_qrl.rollout_sglang.sync.session", "megatron_qrl.sync.transport",
                "megatron_qrl.rollout.transports", "megatron_qrl.rollout.supervisor",
                "megatron_qrl.rl", "megatron_qrl.quant", "megatron_qrl.config")


@functools.cache
def _loaded(module: str) -> tuple[set[str], set[str]]:
    """``(package modules, other top-level modules)`` in ``sys.modules`` of a fresh
    interpreter after ``import module``."""
    code = ("import json, sys\n"
            f"import {module}\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    names = set(json.loads(out.stdout.strip().splitlines()[-1]))
    own = {n for n in names if n == "megatron_qrl" or n.startswith("megatron_qrl.")}
    return own, {n.split(".")[0] for n in names - own}


def _parents(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("loader", [LOADER, STORAGE])
def test_the_sglang_loader_loads_none_of_the_trainer_side(loader):
    entry = loader.rpartition(".")[0]
    own, _ = _loaded(entry)
    trainer = sorted(n for n in own if _under(n, TRAINER_SIDE))
    assert not trainer, f"importing {entry} (inside SGLang) loads the trainer's side: {trainer}"
    allowed = ("megatron_qrl.rollout_sglang.sync.loader", "megatron_qrl.rollout_sglang.sync.debug",
               "megatron_qrl.sync.protocol", PARSER, KERNEL_CHOICE)
    extra = sorted(n for n in own if not _under(n, allowed) and n not in _parents(entry)
                   | _parents(PARSER) | _parents("megatron_qrl.sync.protocol.x"))
    assert not extra, f"importing {entry} loads more than the loader and the protocol: {extra}"


@pytest.mark.parametrize("module", [
    "megatron_qrl.sync.protocol.wire",
    "megatron_qrl.sync.protocol.checksums",
    "megatron_qrl.sync.protocol.inplace",
    "megatron_qrl.sync.protocol.engine_layout",
    "megatron_qrl.rollout_sglang.sync.protocol",  # the re-export both sides used to import
    "megatron_qrl.sync.transport",  # the transports' interface: on the protocol alone
])
def test_the_protocol_imports_only_torch_and_the_name_parser(module):
    """... and the fingerprints' kernel switch (which imports Triton only when it is chosen)."""
    own, others = _loaded(module)
    protocol = "megatron_qrl.sync.protocol"
    extra = sorted(n for n in own if not _under(n, (module, protocol, PARSER, KERNEL_CHOICE))
                   and n not in _parents(module) | _parents(protocol) | _parents(PARSER))
    assert not extra, f"{module} loads more of the package than the name parser: {extra}"
    _, with_torch = _loaded("torch")
    foreign = sorted(others - with_torch - set(sys.stdlib_module_names))
    assert not foreign, f"{module} imports more than torch and the standard library: {foreign}"
