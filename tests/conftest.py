"""Fixtures shared across the test folders (a module that needs another variant defines its own,
which takes precedence), and how the suite is spread over pytest-xdist workers.

``pytest -q`` runs on two xdist workers (``addopts`` in pyproject.toml; ``-n 0`` runs in one
process). A worker takes a whole test module at a time, so a module's fixtures are built once;
the modules that start a local Ray cluster form one unit, run one after another on one worker,
so that no two clusters start side by side (:func:`pytest_xdist_make_scheduler`). Modules
holding ``slow`` tests are handed out first: the longest jobs first keep both workers busy to
the end. Multi-process gloo tests need nothing more: each rendezvous port is drawn at random
outside the ephemeral range and checked free (``megatron_qrl.utils.net.free_port``).
"""

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the two cores: one intra-op thread each (subprocesses inherit it)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

RAY_UNIT = "ray"
_RAY_STARTS = ("ray.init(", "ray_runs(")
"""Source text of a test module that starts (or calls a helper that starts) a local Ray cluster."""


def starts_ray(path: Path) -> bool:
    """Whether the test module at ``path`` starts a local Ray cluster."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return False
    return any(s in text for s in _RAY_STARTS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole modules per worker, every Ray-starting module in one unit."""
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath
    ray_files: dict[str, bool] = {}

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path not in ray_files:
                ray_files[path] = starts_ray(root / path)
            return RAY_UNIT if ray_files[path] else path

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """On an xdist worker: the modules with the most ``slow`` tests first (stable otherwise)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
    first = {path: i for i, path in enumerate(slow)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return (-slow[path], first[path])

    items.sort(key=key)


@pytest.fixture(scope="module")
def megatron():
    """A one-rank megatron-core world for the module (gloo; megatron's CPU shim on a CPU-only
    host), with torch's structured-trace logger quiet (it slows CPU tests under log capture)."""
    from megatron_qrl.models.runtime import single_process_megatron
    from tests.helpers.te_quant_fixtures import quiet_torch_trace

    with quiet_torch_trace(), single_process_megatron():
        yield
