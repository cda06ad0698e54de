"""``python tests/helpers/rl_ray_helper.py [--kill CALL:N,...] [--exit-in-update N] [--calls FILE] ARGS``.

Runs ``qrl-train ARGS`` (a Ray mode; ``RAY_ADDRESS`` names the test's cluster) with test
hooks on the engine actor (tests only). Also runs as a torchrun script (every rank installs
the hooks; only rank 0 has an engine actor):

* ``--kill CALL:N[,CALL:N...]`` ``ray.kill``s the actor just before the N-th call of its
  method CALL (1-based, counted over the whole run and every actor; for ``update_weights``
  after the buckets are in the object store, or — broadcast / ipc transports, whose actor
  methods ``update_weights_broadcast`` / ``update_weights_ipc`` count as ``update_weights``
  — after the weight group is formed and before the broadcast); ``--kill-at N`` is
  ``--kill generate:N``.
* ``--exit-in-update N``: each actor process ``os._exit``s in its own N-th
  ``update_weights``, after reading the first bucket (objectstore) or the first tensor of the
  broadcast or of the first shared bucket (ipc): a death half-way through a sync.
* ``--exit-in-sharded-update N``: the first engine actor (of all, once per run) to reach its
  own N-th sharded update (``update_weights_sharded``, trainer EP > 1) ``os._exit``s after
  the first tensor of it: one fleet engine dies in the middle of a sharded sync.
* ``--gather-experts``: the gathering weight sync even where the sharded one applies
  (``megatron_qrl.rl.ep_sync.sharded_sync_applies`` answers False).
* ``--ep-log DIR``: each rank writes ``DIR/rank<R>.json`` at exit: the bytes the weight
  streams all-gathered from other ranks over the expert-parallel group
  (``models.streaming._all_gather``), and the sharded sends of this rank
  (``ep_sync.send_segments`` calls, bytes).
* ``--kill-node PID:CALL:N``: just before the N-th call of CALL (counted as for ``--kill``)
  kill process PID (a Ray node's raylet: its actors die with it) and wait until Ray reports
  that node dead: a node of the Ray cluster goes away.
* ``--calls FILE`` writes the call log of the last actor (update_weights / generate /
  release_memory / resume_memory, in order) as JSON lines when it is shut down, plus the
  number of restarts.
"""

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
warnings.filterwarnings("ignore")

import megatron_qrl.rl.ray_modes as ray_modes  # noqa: E402
from megatron_qrl.rl.cli import main  # noqa: E402
from megatron_qrl.rl.ray_modes import RayRolloutEngine  # noqa: E402
from megatron_qrl.rollout.ray_actor import EngineActor, RayEngine  # noqa: E402


class ExitingActor(EngineActor):
    """An engine actor whose process exits in the middle of its N-th weight update."""

    exit_at = 0

    def update_weights(self, bucket_refs, version):
        import ray

        self.n_updates = getattr(self, "n_updates", 0) + 1
        if self.n_updates == self.exit_at:
            ray.get(bucket_refs[0])  # it has read part of the stream ...
            os._exit(1)  # ... and its process is gone
        super().update_weights(bucket_refs, version)

    def update_weights_broadcast(self, version):
        from megatron_qrl.rollout.broadcast import receive_stream

        self.n_updates = getattr(self, "n_updates", 0) + 1
        if self.n_updates == self.exit_at:
            next(receive_stream(self.weight_group, self.weight_device))
            os._exit(1)
        super().update_weights_broadcast(version)

    def update_weights_ipc(self, version):
        from megatron_qrl.rollout.ipc import receive_ipc_stream

        self.n_updates = getattr(self, "n_updates", 0) + 1
        if self.n_updates == self.exit_at:
            next(receive_ipc_stream(self.weight_group))
            os._exit(1)
        super().update_weights_ipc(version)

    exit_sharded_at = 0
    claim = ""
    """A file the first actor to exit in a sharded update creates (the others, and restarted
    actors, then do not exit)."""

    def update_weights_sharded(self, version):
        from megatron_qrl.rollout.weight_groups import receive_sharded

        self.n_sharded = getattr(self, "n_sharded", 0) + 1
        if self.n_sharded == self.exit_sharded_at and _claim(self.claim):
            next(receive_sharded(self.weight_groups, self.weight_device))
            os._exit(1)
        super().update_weights_sharded(version)


def _claim(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _pop(argv: list[str], flag: str) -> str | None:
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i:i + 2]
    return value


def _kill_node(pid: int) -> None:
    import signal
    import time

    import ray

    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while sum(1 for n in ray.nodes() if n.get("Alive")) >= alive and time.monotonic() < deadline:
        time.sleep(0.2)


def _install_hooks(kills: dict[str, set[int]], calls: str | None,
                   node_kill: tuple[int, str, int] | None = None) -> None:
    import ray

    call, shutdown = RayEngine._call, RayRolloutEngine.shutdown
    counts: dict[str, int] = {}

    def killing_call(self, method, *args, **kwargs):
        key = method.removesuffix("_broadcast").removesuffix("_ipc")
        counts[key] = counts.get(key, 0) + 1
        if counts[key] in kills.get(key, ()):
            ray.kill(self.actor, no_restart=True)
        if node_kill is not None and (key, counts[key]) == node_kill[1:]:
            _kill_node(node_kill[0])
        return call(self, method, *args, **kwargs)

    def logging_shutdown(self):
        if calls is not None:
            with open(calls, "a") as f:
                f.write(json.dumps({"calls": self.actor.call_log(),
                                    "restarts": self.restarts}) + "\n")
        shutdown(self)

    RayEngine._call = killing_call
    RayRolloutEngine.shutdown = logging_shutdown


def _kills(spec: str | None, kill_at: str | None) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    items = ([s for s in spec.split(",") if s] if spec else []) + (
        [f"generate:{kill_at}"] if kill_at else [])
    for item in items:
        method, n = item.split(":")
        out.setdefault(method, set()).add(int(n))
    return out


def _ep_hooks(gather_experts: bool, log_dir: str | None) -> None:
    import atexit

    import megatron_qrl.models.streaming as streaming
    import megatron_qrl.rl.driver as driver
    import megatron_qrl.rl.ep_sync as ep_sync

    if gather_experts:
        driver.sharded_sync_applies = lambda *a, **k: False
    if log_dir is None:
        return
    log = {"ep_gather_bytes": 0, "sharded_sends": 0}
    gather, send = streaming._all_gather, ep_sync.send_segments

    def counting_gather(tensor, group):
        from megatron.core import parallel_state

        parts = gather(tensor, group)
        if group is not None and group is parallel_state.get_expert_model_parallel_group():
            log["ep_gather_bytes"] += (len(parts) - 1) * tensor.numel() * tensor.element_size()
        return parts

    def counting_send(stream, *args, **kwargs):
        log["sharded_sends"] += 1
        return send(stream, *args, **kwargs)

    def write() -> None:
        Path(log_dir, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(log))

    streaming._all_gather, ep_sync.send_segments = counting_gather, counting_send
    atexit.register(write)


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack on stderr
    argv = sys.argv[1:]
    kill, kill_at = _pop(argv, "--kill"), _pop(argv, "--kill-at")
    exit_in_update, calls = _pop(argv, "--exit-in-update"), _pop(argv, "--calls")
    if exit_in_update:
        ExitingActor.exit_at = int(exit_in_update)
        ray_modes.EngineActor = ExitingActor
    exit_sharded = _pop(argv, "--exit-in-sharded-update")
    if exit_sharded:
        import atexit
        import tempfile
        import uuid

        import megatron_qrl.rl.ray_fleet as ray_fleet

        ExitingActor.exit_sharded_at = int(exit_sharded)
        ExitingActor.claim = os.path.join(tempfile.gettempdir(), f"qrl-exit-{uuid.uuid4().hex}")
        atexit.register(lambda: Path(ExitingActor.claim).unlink(missing_ok=True))
        ray_fleet.EngineActor = ExitingActor
    node = _pop(argv, "--kill-node")
    node_kill = None
    if node:
        pid, method, n = node.split(":")
        node_kill = (int(pid), method, int(n))
    _install_hooks(_kills(kill, kill_at), calls, node_kill)
    gather_experts = "--gather-experts" in argv
    if gather_experts:
        argv.remove("--gather-experts")
    _ep_hooks(gather_experts, _pop(argv, "--ep-log"))
    sys.exit(main(argv))
