"""A crashed SGLang child fails the engine call instead of killing the trainer
(megatron_qrl.rollout_sglang.crash). SGLang cannot run here, so the engine below does what
SGLang 0.5.17's does with SIGQUIT: its tokenizer manager adds a process-killing SIGQUIT
handler to the event loop on first use; the real signal is delivered to this process while
the main thread waits inside ``loop.run_until_complete`` (as it waits on a dead scheduler)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from megatron_qrl.rollout.supervisor import EngineDiedError
from megatron_qrl.rollout_sglang import crash


@pytest.fixture(autouse=True)
def restore_sigquit():
    old = signal.getsignal(signal.SIGQUIT)
    crash.mark_alive()
    yield
    signal.signal(signal.SIGQUIT, old)
    crash.mark_alive()


class FakeTokenizerManager:
    def __init__(self, loop, killed):
        self.loop, self.killed, self.event_loop = loop, killed, None

    def auto_create_handle_loop(self):  # as SGLang: adds its kill-everything handler
        if self.event_loop is None:
            self.event_loop = asyncio.get_running_loop()
            self.loop.add_signal_handler(signal.SIGQUIT, lambda: self.killed.append(True))


class FakeEngine:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.killed: list[bool] = []
        self.tokenizer_manager = FakeTokenizerManager(self.loop, self.killed)


def _sigquit_after(seconds: float) -> threading.Timer:
    t = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGQUIT))
    t.start()
    return t


def test_crash_during_a_call_interrupts_it_and_sglangs_handler_is_gone():
    eng = FakeEngine()
    try:
        assert crash.install(eng)
        assert eng.tokenizer_manager.event_loop is eng.loop  # created inside the engine's loop
        _sigquit_after(0.2)
        t0 = time.monotonic()
        with pytest.raises(EngineDiedError, match="SGLang engine process crashed"):
            with crash.engine_call():
                eng.loop.run_until_complete(asyncio.sleep(10))  # "waiting on a dead child"
        assert time.monotonic() - t0 < 5
        eng.loop.run_until_complete(asyncio.sleep(0.05))  # the loop sees the signal too
        assert eng.killed == []  # SGLang's process-killing handler never ran
    finally:
        eng.loop.close()


def test_crash_between_calls_fails_the_next_call():
    signal.signal(signal.SIGQUIT, crash.on_child_crash)
    os.kill(os.getpid(), signal.SIGQUIT)
    time.sleep(0.05)  # delivered here, outside any engine call: no exception
    with pytest.raises(EngineDiedError, match="crashed earlier"):
        with crash.engine_call():
            pass
    crash.mark_alive()  # a restarted engine
    with crash.engine_call():
        pass


def test_install_outside_the_main_thread_leaves_handlers_alone():
    eng = FakeEngine()
    out = []
    th = threading.Thread(target=lambda: out.append(crash.install(eng)))
    th.start()
    th.join()
    eng.loop.close()
    assert out == [False] and eng.tokenizer_manager.event_loop is None


def test_crash_inside_another_task_still_ends_the_call():
    """The handler runs inside whatever the main thread executes: here a step of a busy
    background task (SGLang's handle loop), where asyncio keeps the exception to that task.
    The awaited request must still end, with EngineDiedError, instead of waiting forever."""
    eng = FakeEngine()

    async def busy():  # CPU work in a task step while the signal arrives
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            pass

    async def request():  # waits on a dead scheduler: nothing will ever set it
        eng.loop.create_task(busy())
        await asyncio.Event().wait()

    logged = []  # what the loop would print as an unhandled error (uvloop did, on the H200)
    eng.loop.set_exception_handler(lambda loop, ctx: logged.append(ctx))
    try:
        assert crash.install(eng)
        _sigquit_after(0.3)
        t0 = time.monotonic()
        with pytest.raises(EngineDiedError, match="SGLang engine process crashed"):
            with crash.engine_call():
                eng.loop.run_until_complete(asyncio.wait_for(request(), timeout=8))
        assert time.monotonic() - t0 < 5  # not the 8 s timeout: the call was ended
        assert eng.killed == []
        eng.loop.run_until_complete(asyncio.sleep(0.05))
        assert logged == []
    finally:
        eng.loop.close()
