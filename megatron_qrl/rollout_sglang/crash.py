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
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ..rollout.supervisor import EngineDiedError

__all__ = ["engine_call", "install", "mark_alive", "on_child_crash"]

_STATE: dict[str, Any] = {"dead": False, "calls": 0, "loop": None}
_CRASHED = ("an SGLang engine process crashed (SIGQUIT from SGLang's subprocess watchdog; see "
            "the scheduler log above)")


def on_child_crash(signum: int = signal.SIGQUIT, frame: Any = None) -> None:
    """SIGQUIT handler (also SGLang's ``custom_sigquit_handler`` during the engine's launch):
    mark the engine dead; inside an engine call, end it with :class:`EngineDiedError`.

    Python runs the handler wherever the main thread is. Inside the engine's event loop that is
    often a step of some task or a callback, and asyncio keeps an exception raised there to
    that task (or logs and drops it, for a callback): the awaited request would then wait
    forever on the dead scheduler. So every task of the engine's loop is cancelled;
    :func:`engine_call` turns what the call then raises into :class:`EngineDiedError`. While
    the loop runs, that cancellation is what ends the call and nothing is raised here: uvloop
    (SGLang's loop) runs Python signal handlers inside one of its callbacks, which would log
    the exception as an unhandled traceback (seen in the H200 restart test) and drop it.
    """
    _STATE["dead"] = True
    if _STATE["calls"]:
        loop = _STATE["loop"]
        if loop is not None and not loop.is_closed():
            for task in asyncio.all_tasks(loop):
                task.cancel()
            if loop.is_running():
                loop.call_soon_threadsafe(_wake)  # a loop asleep in select() sees the cancels
                return
        raise EngineDiedError(_CRASHED)


def _wake() -> None:
    """No-op callback: scheduling it thread-safely wakes the loop's selector."""


def mark_alive() -> None:
    """A new engine is up (one in-process engine at a time)."""
    _STATE["dead"] = False


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


def install(engine: Any) -> bool:
    """Replace SGLang's process-killing SIGQUIT handlers with :func:`on_child_crash` for
    ``engine`` (an ``sglang.Engine``). Creates the tokenizer manager's handle loop first (it
    adds its own handler then). Only possible in the main thread (as for SGLang); returns
    whether it was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    tm = engine.tokenizer_manager

    async def create_handle_loop() -> None:
        tm.auto_create_handle_loop()

    engine.loop.run_until_complete(create_handle_loop())
    with contextlib.suppress(Exception):  # no handler there (not added) is fine
        engine.loop.remove_signal_handler(signal.SIGQUIT)
    signal.signal(signal.SIGQUIT, on_child_crash)
    _STATE["loop"] = engine.loop
    mark_alive()
    return True
