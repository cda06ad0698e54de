"""A crashed SGLang child fails the engine call instead of killing the trainer
(megatron_qrl.rollout_sglang.crash). SGLang cannot run here, so the engine below does what
SGLang 0.5.17's does with SIGQUIT: each engine makes a new event loop (uvloop under SGLang's
loop policy) and sets it as current, and its tokenizer manager, on first use, adds the
process-killing ``signal_handler_class(self).running_phase_sigquit_handler`` to that loop (here
it only records that it ran). The real signal is delivered to this process while the main
thread waits inside ``loop.run_until_complete`` (as it waits on a dead scheduler)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from megatron_qrl.rollout.supervisor import EngineDiedError
from megatron_qrl.rollout_sglang import crash


def _uvloop_policy() -> asyncio.AbstractEventLoopPolicy:
    """uvloop's policy (SGLang's); only the ``uvloop`` cases skip where it is not installed."""
    return pytest.importorskip("uvloop").EventLoopPolicy()


LOOPS = {"asyncio": asyncio.DefaultEventLoopPolicy, "uvloop": _uvloop_policy}


@pytest.fixture(autouse=True)
def restore_signals():
    old = {s: signal.getsignal(s) for s in (signal.SIGQUIT, signal.SIGTERM)}
    crash.mark_alive()
    yield
    for s, handler in old.items():
        signal.signal(s, handler)
    crash.mark_alive()


@pytest.fixture(params=sorted(LOOPS))
def loop_kind(request):
    """The event loop policy new engines get (SGLang sets uvloop's at import); restored after."""
    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(LOOPS[request.param]())
    yield request.param
    asyncio.set_event_loop_policy(old)


class FakeSignalHandler:
    """SGLang 0.5.17's ``SignalHandler`` (tokenizer_manager.py), except that the SIGQUIT
    handler records that it ran where SGLang's ends in ``kill_process_tree(os.getpid())``."""

    def __init__(self, tokenizer_manager):
        self.tokenizer_manager = tokenizer_manager

    def sigterm_handler(self, signum=None, frame=None):
        self.tokenizer_manager.gracefully_exit = True

    def running_phase_sigquit_handler(self, signum=None, frame=None):
        self.tokenizer_manager.killed.append(True)


class FakeTokenizerManager:
    def __init__(self, killed, handler_class=FakeSignalHandler):
        self.killed, self.event_loop, self.gracefully_exit = killed, None, False
        self.asyncio_tasks: set = set()
        if handler_class is not None:  # None: an SGLang without the attribute
            self.signal_handler_class = handler_class

    def auto_create_handle_loop(self):  # as SGLang's (get_or_create_event_loop inlined)
        if self.event_loop is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
        self.asyncio_tasks.add(loop.create_task(self.handle_loop()))
        self.event_loop = loop
        if threading.current_thread() is threading.main_thread():
            handler_class = getattr(self, "signal_handler_class", FakeSignalHandler)
            handler = handler_class(self)
            loop.add_signal_handler(signal.SIGTERM, handler.sigterm_handler)
            loop.add_signal_handler(signal.SIGQUIT, handler.running_phase_sigquit_handler)

    async def handle_loop(self):  # receives from the scheduler: waits forever here
        await asyncio.Event().wait()


class FakeEngine:
    def __init__(self, handler_class=FakeSignalHandler):
        try:  # as sglang.Engine.__init__: a second engine gets a new loop
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
        self.killed: list[bool] = []
        self.tokenizer_manager = FakeTokenizerManager(self.killed, handler_class)

    def shutdown(self):  # as SGLang's: the children go, the loop stays open (not running)
        pass

    def close(self):  # test teardown only
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()
        asyncio.set_event_loop(None)


def _sigquit_after(seconds: float) -> threading.Timer:
    t = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGQUIT))
    t.start()
    return t


def _crash_during_call(eng: FakeEngine) -> None:
    """SIGQUIT while the main thread waits in ``eng``'s loop: EngineDiedError, promptly."""
    _sigquit_after(0.2)
    t0 = time.monotonic()
    with pytest.raises(EngineDiedError, match="SGLang engine process crashed"):
        with crash.engine_call():
            eng.loop.run_until_complete(asyncio.sleep(10))  # "waiting on a dead child"
    assert time.monotonic() - t0 < 5
    eng.loop.run_until_complete(asyncio.sleep(0.05))  # the loop sees the signal too


def test_crash_during_a_call_interrupts_it_and_sglangs_handler_never_runs(loop_kind):
    eng = FakeEngine()
    try:
        assert crash.install(eng)
        assert eng.tokenizer_manager.event_loop is eng.loop  # created inside the engine's loop
        _crash_during_call(eng)
        assert eng.killed == []  # SGLang's process-killing handler never ran
    finally:
        eng.close()


def test_a_second_engine_in_the_same_process_survives_a_crash(loop_kind):
    """The H200 failure: the second in-process engine's scheduler crashed and SGLang's own
    handler (called by the loop, ``signum=None``) killed the trainer."""
    first = FakeEngine()
    second = None
    try:
        assert crash.install(first)
        with crash.engine_call():
            first.loop.run_until_complete(asyncio.sleep(0.01))
        first.shutdown()
        crash.mark_alive()  # as the engine wrapper, before starting the next engine
        second = FakeEngine()
        assert second.loop is not first.loop and type(second.loop) is type(first.loop)
        assert crash.install(second)
        _crash_during_call(second)
        assert first.killed == [] and second.killed == []
    finally:
        for eng in (second, first):
            if eng is not None:
                eng.close()


def test_sglangs_loop_handler_left_in_place_no_longer_kills(loop_kind, monkeypatch):
    """Should the loop's handler stay (an SGLang or loop version where removing it fails),
    it is the handler class's and both it and the process handler report the one crash."""
    monkeypatch.setattr(crash, "_remove_loop_handler", lambda loop: None)
    frames = []  # the process handler gets a frame, the loop's handler None

    def spy(signum=signal.SIGQUIT, frame=None, report=crash.on_child_crash):
        frames.append(frame)
        report(signum, frame)

    monkeypatch.setattr(crash, "on_child_crash", spy)
    eng = FakeEngine()
    try:
        assert crash.install(eng)
        _crash_during_call(eng)  # two reports of one crash: one EngineDiedError
        assert eng.killed == []
        assert len(frames) == 2 and frames.count(None) == 1
        handler = eng.tokenizer_manager.signal_handler_class(eng.tokenizer_manager)
        assert isinstance(handler, FakeSignalHandler)
        handler.sigterm_handler()  # SGLang's own SIGTERM handling is kept
        assert eng.tokenizer_manager.gracefully_exit
    finally:
        eng.close()


def test_an_earlier_engines_handler_does_not_mark_the_next_one_dead():
    tm = FakeTokenizerManager([])
    old_handler = crash.crash_reporting(FakeSignalHandler)(tm)
    assert crash.crash_reporting(type(old_handler)) is type(old_handler)  # never stacked
    crash.mark_alive()  # the next engine
    old_handler.running_phase_sigquit_handler()
    with crash.engine_call():
        pass
    crash.crash_reporting(FakeSignalHandler)(tm).running_phase_sigquit_handler()
    with pytest.raises(EngineDiedError, match="crashed earlier"):
        with crash.engine_call():
            pass
    assert tm.killed == []


def test_without_the_handler_class_attribute_install_still_works(loop_kind):
    eng = FakeEngine(handler_class=None)
    try:
        assert crash.install(eng)
        assert not hasattr(eng.tokenizer_manager, "signal_handler_class")
        _crash_during_call(eng)
        assert eng.killed == []
    finally:
        eng.close()


def test_crash_between_calls_fails_the_next_call():
    signal.signal(signal.SIGQUIT, crash.on_child_crash)
    os.kill(os.getpid(), signal.SIGQUIT)
    time.sleep(0.05)  # delivered here, outside any engine call: no exception
    with pytest.raises(EngineDiedError, match="crashed earlier"):
        with crash.engine_call():
            pass
    crash.on_child_crash()  # the same crash reported again (loop handler): still no exception
    crash.mark_alive()  # a restarted engine
    with crash.engine_call():
        pass


def test_install_outside_the_main_thread_leaves_handlers_alone():
    eng = FakeEngine()
    out = []
    th = threading.Thread(target=lambda: out.append(crash.install(eng)))
    th.start()
    th.join()
    assert out == [False] and eng.tokenizer_manager.event_loop is None
    assert eng.tokenizer_manager.signal_handler_class is FakeSignalHandler
    eng.close()


def test_crash_inside_another_task_still_ends_the_call(loop_kind):
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
        eng.close()
