"""An SGLang child process that dies must not take the trainer with it.

SGLang 0.5.17 (read from its source): the in-process ``sglang.Engine`` runs a
``SubprocessWatchdog`` thread that sends SIGQUIT to its own (= the trainer's) process when
a scheduler or detokenizer process exits with an error, and both SIGQUIT handlers it
installs — ``launch_phase_sigquit_handler`` in ``Engine.__init__`` and the tokenizer
manager's ``running_phase_sigquit_handler`` (added to the event loop on the first request)
— end in ``kill_process_tree(os.getpid())``: the whole trainer is killed, so no restart can
happen. Here SIGQUIT instead marks the engine dead and, when the trainer is inside an engine
call (waiting on the dead child), raises :class:`EngineDiedError` there, which the
:class:`~megatron_qrl.rollout.supervisor.EngineSupervisor` answers with a restart and re-sync.
A crash noticed between calls fails the next call the same way.

Measured on the H200 (SGLang 0.5.17, torch 2.11, Python 3.12): a scheduler that crashed
inside ``update_weights_from_tensor`` still killed pytest (rc 137) through SGLang's loop
handler (logged ``SIGQUIT received. signum=None, frame=None``). The loop is uvloop (SGLang
sets its policy at import), and uvloop's ``remove_signal_handler`` does nothing and returns
False when the loop is not running, which is where the handler used to be removed; while the
loop then ran, the signal byte on its wakeup fd dispatched the handler still registered there.
Reproduced on CPU with uvloop 0.21.0 (tests/rollout_sglang/test_sglang_crash.py: any engine, first or second,
crashed during a call); asyncio's own loop removes it either way. Two guards now, each enough:

* :func:`install` sets the tokenizer manager's ``signal_handler_class`` (its own attribute,
  read before the handle loop is created) to :func:`crash_reporting` of SGLang's class: a
  subclass whose ``running_phase_sigquit_handler`` calls :func:`on_child_crash`, SIGTERM's
  handler unchanged. Without the attribute (another SGLang version) only the next guard is left.
* the loop's SIGQUIT handler is removed inside the running loop, then the process handler set.

Should the loop handler stay, both handlers report the one crash; the second report is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ..rollout.supervisor import EngineDiedError

__all__ = ["crash_reporting", "engine_call", "install", "mark_alive", "on_child_crash"]

_STATE: dict[str, Any] = {"dead": False, "calls": 0, "loop": None, "generation": 0}
_CRASHED = ("an SGLang engine process crashed (SIGQUIT from SGLang's subprocess watchdog; see "
            "the scheduler log above)")


def on_child_crash(signum: int = signal.SIGQUIT, frame: Any = None) -> None:
    """SIGQUIT handler (also SGLang's ``custom_sigquit_handler`` during the engine's launch,
    and the running phase's through :func:`install`'s handler class): mark the engine dead;
    inside an engine call, end it with :class:`EngineDiedError`.

    Python runs the handler wherever the main thread is. Inside the engine's event loop that is
    often a step of some task or a callback, and asyncio keeps an exception raised there to
    that task (or logs and drops it, for a callback): the awaited request would then wait
    forever on the dead scheduler. So every task of the engine's loop is cancelled;
    :func:`engine_call` turns what the call then raises into :class:`EngineDiedError`. While
    the loop runs, that cancellation is what ends the call and nothing is raised here: uvloop
    (SGLang's loop) runs Python signal handlers inside one of its callbacks, which would log
    the exception as an unhandled traceback (seen in the H200 restart test) and drop it.

    One crash may be reported twice (the process handler and the loop's): the second report
    cancels again (harmless) but never raises a second time.
    """
    first = not _STATE["dead"]
    _STATE["dead"] = True
    if _STATE["calls"]:
        loop = _STATE["loop"]
        if loop is not None and not loop.is_closed():
            for task in asyncio.all_tasks(loop):
                task.cancel()
            if loop.is_running():
                loop.call_soon_threadsafe(_wake)  # a loop asleep in select() sees the cancels
                return
        if first:
            raise EngineDiedError(_CRASHED)


def _wake() -> None:
    """No-op callback: scheduling it thread-safely wakes the loop's selector."""


def mark_alive() -> None:
    """A new engine is being started (one in-process engine at a time): earlier crashes, and
    reports still to come from an earlier engine's loop handler, no longer count."""
    _STATE["dead"] = False
    _STATE["generation"] += 1


@contextlib.contextmanager
def engine_call() -> Iterator[None]:
    """Wrap every call into the in-process engine: a crash reported before the call fails it
    at once, one reported during it interrupts it."""
    if _STATE["dead"]:
        raise EngineDiedError("an SGLang engine process crashed earlier (SIGQUIT from SGLang's "
                              "subprocess watchdog); the engine must be restarted")
    _STATE["calls"] += 1
    try:
        yield
    except BaseException as exc:  # CancelledError / a stopped loop after a crash, or the error
        if _STATE["dead"] and not isinstance(exc, EngineDiedError):
            raise EngineDiedError(_CRASHED) from exc
        raise
    finally:
        _STATE["calls"] -= 1


def crash_reporting(base: type) -> type:
    """A subclass of SGLang's tokenizer-manager signal handler class ``base`` whose running-phase
    SIGQUIT handler reports the crash (:func:`on_child_crash`) where SGLang's ends in
    ``kill_process_tree(os.getpid())``; its SIGTERM handler stays SGLang's. Reports reaching it
    after :func:`mark_alive` (a newer engine) are ignored."""
    if getattr(base, "reports_crash", False):
        return base
    generation = _STATE["generation"]

    class CrashReporting(base):  # type: ignore[misc,valid-type]
        reports_crash = True

        def running_phase_sigquit_handler(self, signum: Any = None, frame: Any = None) -> None:
            if _STATE["generation"] == generation:
                on_child_crash(signal.SIGQUIT, frame)

    CrashReporting.__name__ = CrashReporting.__qualname__ = f"CrashReporting{base.__name__}"
    return CrashReporting


def _remove_loop_handler(loop: asyncio.AbstractEventLoop) -> None:
    """Drop the loop's SIGQUIT handler. Called while ``loop`` runs: uvloop's
    ``remove_signal_handler`` does nothing (returns False) on a loop that is not running."""
    with contextlib.suppress(Exception):  # no handler there (not added) is fine
        loop.remove_signal_handler(signal.SIGQUIT)


def install(engine: Any) -> bool:
    """Replace SGLang's process-killing SIGQUIT handlers with :func:`on_child_crash` for
    ``engine`` (an ``sglang.Engine``): its tokenizer manager's ``signal_handler_class`` becomes
    :func:`crash_reporting` of itself (where the attribute exists), then its handle loop is
    created inside the engine's running loop, whose SIGQUIT handler is removed there, and the
    process's SIGQUIT handler is set. Only possible in the main thread (as for SGLang); returns
    whether it was installed. A crash reported since :func:`mark_alive` still counts."""
    if threading.current_thread() is not threading.main_thread():
        return False
    tm = engine.tokenizer_manager
    base = getattr(tm, "signal_handler_class", None)
    if isinstance(base, type):  # absent in other SGLang versions: the removal below only
        tm.signal_handler_class = crash_reporting(base)

    async def create_handle_loop() -> None:
        tm.auto_create_handle_loop()
        _remove_loop_handler(asyncio.get_running_loop())

    engine.loop.run_until_complete(create_handle_loop())
    signal.signal(signal.SIGQUIT, on_child_crash)
    _STATE["loop"] = engine.loop
    return True
