"""Fixtures shared across the test folders (a module that needs another variant defines its own,
which takes precedence), and how the suite is spread over pytest-xdist workers.

``pytest -q`` runs on two xdist workers (``addopts`` in pyproject.toml; ``-n 0`` runs in one
process). A worker takes a whole test module at a time, so a module's fixtures are built once;
the modules that start a local Ray cluster form ``RAY_UNITS`` units of about equal seconds,
each run one module after another on one worker, so that a worker's Ray modules share one
cluster (:func:`local_ray`) where they need no cluster of their own and start it once
(:func:`pytest_xdist_make_scheduler`). The longest units are handed out first
(:func:`pytest_collection_modifyitems`: seconds per module from the last whole run, kept in
pytest's cache, else the count of ``slow`` tests), so that both workers finish together.
Multi-process gloo tests need nothing more: each rendezvous port is drawn at random outside the
ephemeral range and checked free (``megatron_qrl.utils.net.free_port``).
"""

import contextlib
import functools
import json
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the two cores: one intra-op thread each (subprocesses inherit it)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray starts its worker processes (the engine actors) at nice 15: beside a busy test worker on
# a 2-core host an actor then gets a few percent of a core, and the Ray test waiting on it idles.
# Every cluster the tests start (in this process or in a subprocess job) inherits this.
os.environ.setdefault("RAY_worker_niceness", "0")

RAY_UNIT = "ray"
RAY_UNITS = 2
"""Units the Ray modules are split into: one per xdist worker (the Ray modules together take
about as long as the rest of the suite; in one unit they would set its wall time)."""
_RAY_STARTS = ("ray.init(", "ray_runs(", "local_ray")
"""Source text of a test module that starts (or calls a helper that starts) a local Ray cluster."""


@functools.cache
def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def starts_ray(path: Path) -> bool:
    """Whether the test module at ``path`` starts a local Ray cluster."""
    return any(s in _text(path) for s in _RAY_STARTS)


def ray_units(root: Path, seconds: dict[str, float]) -> dict[str, str]:
    """Each Ray-starting test module under ``root/tests`` (relative path) -> its unit's name:
    longest first onto the unit with the fewest seconds so far (a module's seconds from the
    last whole run, else ``SLOW_SECONDS``). The controller and every worker read the same
    seconds (:func:`module_seconds`), so they agree."""
    paths = sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                   if starts_ray(p))
    load = {f"{RAY_UNIT}{i}": 0.0 for i in range(RAY_UNITS)}
    units = {}
    for path in sorted(paths, key=lambda p: -seconds.get(p, SLOW_SECONDS)):
        unit = min(load, key=lambda u: (load[u], u))
        units[path] = unit
        load[unit] += seconds.get(path, SLOW_SECONDS)
    return units


_SECONDS = pytest.StashKey[dict]()
_RAY_UNITS = pytest.StashKey[dict]()


def module_seconds(config) -> dict[str, float]:
    """Seconds per test module: the last whole run's (pytest's cache) over the committed
    ``SECONDS_FILE`` (a fresh checkout, CI)."""
    seconds = config.stash.get(_SECONDS, None)
    if seconds is None:
        try:
            seconds = json.loads((config.rootpath / SECONDS_FILE).read_text())
        except (OSError, ValueError):
            seconds = {}
        cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
        seconds.update(cache.get(MODULE_SECONDS, {}) if cache is not None else {})
        config.stash[_SECONDS] = seconds
    return seconds


def _ray_units(config) -> dict[str, str]:
    units = config.stash.get(_RAY_UNITS, None)
    if units is None:
        units = config.stash[_RAY_UNITS] = ray_units(config.rootpath, module_seconds(config))
    return units


def _unit(config, path: str) -> str:
    """A module's scheduling unit: its Ray unit, else the module itself."""
    units = _ray_units(config)
    if path in units:
        return units[path]
    return RAY_UNIT if starts_ray(config.rootpath / path) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole modules per worker, the Ray-starting modules in ``RAY_UNITS`` units."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(config, nodeid.split("::", 1)[0])

    return ModuleScheduling(config, log)


MODULE_SECONDS = "megatron_qrl/module_seconds"
"""pytest's cache key: seconds per test module (setup + call + teardown) in the last whole run."""
SECONDS_FILE = "tests/module_seconds.json"
"""Seconds per test module of a whole run on the 2-core machine, committed: the order where
pytest's cache has none."""
SLOW_SECONDS = 60.0
"""What a ``slow`` test is taken to cost where the cache has no time for its module."""


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    """On an xdist worker: the longest units first (longest processing time first: both workers
    then finish together). A module costs its seconds in the last whole run
    (:func:`module_seconds`), else ``SLOW_SECONDS`` per ``slow`` test; a Ray unit costs the sum
    of its modules and keeps them together, those that start clusters of their own first (the
    shared one then starts once). Stable otherwise."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    seconds = module_seconds(config)
    slow: dict[str, int] = {}
    for item in items:
        path = _module(item.nodeid)
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
    cost = {path: seconds.get(path, SLOW_SECONDS * n) for path, n in slow.items()}
    first = {path: i for i, path in enumerate(slow)}
    unit = {path: _unit(config, path) for path in slow}
    unit_cost: dict[str, float] = {}
    unit_first: dict[str, int] = {}
    for path in slow:
        unit_cost[unit[path]] = unit_cost.get(unit[path], 0.0) + cost[path]
        unit_first.setdefault(unit[path], first[path])

    def key(item):  # in the Ray unit the modules with clusters of their own first
        path = _module(item.nodeid)
        u = unit[path]
        shared = not _own_cluster(config.rootpath / path)  # local_ray: started once
        return (-unit_cost[u], unit_first[u], shared, -cost[path], first[path])

    items.sort(key=key)


class ModuleSeconds:
    """Adds up each module's seconds in a whole ``pytest`` run (no paths, ``-k`` or ``-m``) on
    xdist workers and keeps them in pytest's cache for the next run's order."""

    def __init__(self, config):
        self.config, self.seconds = config, {}

    def pytest_runtest_logreport(self, report):
        path = _module(report.nodeid)
        self.seconds[path] = self.seconds.get(path, 0.0) + report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        if self.seconds and exitstatus in (0, 1):  # finished, with or without failures
            kept = self.config.cache.get(MODULE_SECONDS, {})
            kept.update({path: round(s, 1) for path, s in self.seconds.items()})
            self.config.cache.set(MODULE_SECONDS, kept)


PRINT_FAILURES = "QRL_PRINT_FAILURES"
"""Environment variable: when set (``bench/h200.sh gpu-tests`` sets it), each failure's report
is written to stderr as it happens, by the controlling process (xdist's or the only one), so
a run cut short by its time limit keeps the evidence of what already failed."""


def failure_text(report) -> str | None:
    """The lines :data:`PRINT_FAILURES` writes for one test report (None unless it failed)."""
    if not report.failed:
        return None
    out = f"-- its stdout --\n{report.capstdout}" if report.capstdout else ""
    return f"\n== FAILED {report.nodeid} ({report.when}) ==\n{report.longreprtext}\n{out}"


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if os.environ.get(PRINT_FAILURES) and not os.environ.get("PYTEST_XDIST_WORKER"):
        text = failure_text(report)
        if text:
            sys.stderr.write(text)
            sys.stderr.flush()


def pytest_configure(config):
    whole = (config.args_source == pytest.Config.ArgsSource.TESTPATHS
             and not config.option.keyword and not config.option.markexpr)
    workers = getattr(config.option, "numprocesses", None)
    if (whole and workers and getattr(config, "cache", None) is not None
            and not os.environ.get("PYTEST_XDIST_WORKER")):
        config.pluginmanager.register(ModuleSeconds(config), "qrl-module-seconds")


@pytest.fixture(scope="module")
def megatron():
    """A one-rank megatron-core world for the module (gloo; megatron's CPU shim on a CPU-only
    host), with torch's structured-trace logger quiet (it slows CPU tests under log capture)."""
    from megatron_qrl.models.runtime import single_process_megatron
    from tests.helpers.te_quant_fixtures import quiet_torch_trace

    with quiet_torch_trace(), single_process_megatron():
        yield


class LocalRay:
    """The worker's local Ray cluster, started on first use and kept for the next module: 4 CPUs
    (the fleet's 3 engine actors + a trainer bundle); its processes inherit the repository on
    ``PYTHONPATH`` (actor classes of test modules) and one intra-op thread, set in the
    environment the raylet starts with rather than as a runtime env (the idle workers Ray starts
    with the cluster then serve the actors). :meth:`stop` frees the worker for a module that
    starts a cluster of its own; the next :meth:`address` starts a fresh one."""

    STARTS = 3
    """Attempts at a start: a raylet that misses Ray's fixed 30 s start-up window on a loaded
    host is retried."""

    def __init__(self):
        self._address: str | None = None
        self._ray_env: dict[str, str] | None = None
        """The worker's ``RAY_*`` variables before the start: ``ray.init`` sets some (e.g.
        ``RAY_AUTH_MODE``) and leaves them after shutdown, where the modules that follow
        would hand them to their subprocesses."""

    def address(self) -> str:
        """The GCS address (``RAY_ADDRESS`` for subprocess jobs); the ``ray`` driver connected."""
        ray = pytest.importorskip("ray")
        if self._address is None or not ray.is_initialized():
            repo = str(Path(__file__).resolve().parents[1])
            env = {"PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
                   "OMP_NUM_THREADS": "1"}
            saved = {k: os.environ.get(k) for k in env}
            self._ray_env = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
            os.environ.update(env)
            try:
                self._address = self._start(ray)
            finally:
                for k, v in saved.items():
                    if v is None:
                        del os.environ[k]
                    else:
                        os.environ[k] = v
        return self._address

    def _start(self, ray) -> str:
        import psutil

        me = psutil.Process()
        for attempt in range(self.STARTS):
            before = {p.pid for p in me.children(recursive=True)}
            try:
                ctx = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
                return ctx.address_info["gcs_address"]
            except Exception as e:
                ray.shutdown()  # not the processes of a failed start (GCS, monitor ...): by pid
                for p in me.children(recursive=True):
                    if p.pid not in before:
                        with contextlib.suppress(psutil.NoSuchProcess):
                            p.kill()
                if "timed out during startup" not in str(e) or attempt == self.STARTS - 1:
                    raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self._address is not None:
            import ray

            ray.shutdown()
            self._address = None
        if self._ray_env is not None:  # the worker's RAY_* variables as before the start
            for k in [k for k in os.environ if k.startswith("RAY_")]:
                del os.environ[k]
            os.environ.update(self._ray_env)
            self._ray_env = None


_LOCAL_RAY = pytest.StashKey[LocalRay]()


@pytest.fixture(scope="session")
def local_ray(request):
    """One :class:`LocalRay` per worker (a Ray start costs 5-30 s on a loaded 2-core host)."""
    cluster = request.config.stash[_LOCAL_RAY] = LocalRay()
    yield cluster
    cluster.stop()


def _own_cluster(path: Path) -> bool:
    """Whether the test module at ``path`` starts Ray clusters of its own (``ray.init``)."""
    return "ray.init(" in _text(path)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """The shared cluster stops after the last Ray module in a row (its idle processes would
    take CPU from the modules that follow on the worker) and before a module that starts
    clusters of its own (one driver connection per process)."""
    cluster = item.config.stash.get(_LOCAL_RAY, None)
    if cluster is not None and (nextitem is None or not starts_ray(nextitem.path)
                                or _own_cluster(nextitem.path)):
        cluster.stop()
