"""Rank 0's messages to the other ranks (``rl.rank_resync``) and the ranks' board
(``utils.ranks``): the protocol's cases in two gloo processes, the board on a real TCPStore.

The case that broke: a rank waiting in the EP-sharded sync for rank 0's header receives a
re-sync announcement instead (rank 0 found the fleet's engine dead before the groups formed,
restarted it, and re-syncs), then rank 0 gives up (the restarted engine cannot be placed).
The waiting rank must take the announcement as the start of the re-sync and stop with rank
0's line — not fail to unpack the announcement as a header.
"""

from __future__ import annotations

import datetime
import socket
import time

import pytest

from tests.helpers.mp_utils import free_port, run_distributed


def _init(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))


def _sharded_wait_then_stop(rank: int, world_size: int, port: int) -> str:
    import torch.distributed as dist

    from megatron_qrl.models.runtime import RankWorld
    from megatron_qrl.rl.ep_sync import ShardedSync
    from megatron_qrl.rl.rank_resync import MainRankStopped, ResyncWorld

    _init(rank, world_size, port)
    try:
        world = ResyncWorld.of(RankWorld(rank, world_size), serve=lambda: None)
        if rank == 0:
            world.announce_resync()  # the re-sync of a restarted engine ...
            world.stop(RuntimeError("fleet engine 1 cannot be started again\nmore"))  # ... gave up
            return "sent"
        try:  # rank 1 waits for a sharded sync's header (nothing of the trainer used yet)
            ShardedSync(trainer=None, spec=None, aqn=None, seed=0).serve()
        except MainRankStopped as exc:
            return str(exc)
        return "served"
    finally:
        dist.destroy_process_group()


def _from_main(rank: int, world_size: int, port: int) -> list[str]:
    import torch.distributed as dist

    from megatron_qrl.models.runtime import RankWorld
    from megatron_qrl.rl.rank_resync import MainRankStopped, ResyncWorld

    _init(rank, world_size, port)
    seen: list[str] = []
    try:
        world = ResyncWorld.of(RankWorld(rank, world_size), serve=lambda: seen.append("served"))
        if rank == 0:
            world.announce_resync()  # a restart in the rollout: the others serve its re-sync
            seen.append(str(world.from_main(lambda: "batch")))
            try:
                world.from_main(lambda: (_ for _ in ()).throw(OSError("engine gone")))
            except OSError:
                seen.append("raised")
            return seen
        seen.append(world.from_main(lambda: "never on rank 1"))
        try:
            world.from_main(lambda: None)
        except MainRankStopped as exc:
            seen.append(str(exc))
        return seen
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_resync_then_stop_reaches_a_rank_waiting_for_a_sharded_header():
    out = run_distributed(_sharded_wait_then_stop, 2, timeout_s=120)
    assert out == ["sent", "rank 0 stopped the job: RuntimeError: fleet engine 1 cannot be "
                           "started again"]


@pytest.mark.slow
def test_rank_0_error_in_from_main_stops_the_others_with_its_line():
    out = run_distributed(_from_main, 2, timeout_s=120)
    assert out == [["batch", "raised"],
                   ["served", "batch", "rank 0 stopped the job: OSError: engine gone"]]


@pytest.fixture
def store_port():
    import torch.distributed as dist

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield port
    del master


def _board(port: int, rank: int, world: int = 2):
    from megatron_qrl.utils.ranks import RankBoard

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GROUP_RANK": str(rank),
           "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "t"}
    return RankBoard(rank, world, timeout_s=5, env=env)


def test_wait_for_ranks_names_the_missing_node_after_the_timeout(store_port):
    from megatron_qrl.utils.ranks import StartupTimeoutError

    logs: list[str] = []
    start = time.monotonic()
    with pytest.raises(StartupTimeoutError, match=r"waited 1 s for node \[1\] \(ranks \[1\]\) "
                                                  r"to join 127\.0\.0\.1:\d+;.*--node-rank"):
        _board(store_port, 0).wait_for_ranks(1.0, logs.append, every_s=0.3)
    assert time.monotonic() - start < 5
    assert logs[0].startswith("waiting for 2 nodes / 2 ranks at 127.0.0.1:")
    assert any("still waiting for node [1]" in m for m in logs[1:])


def test_wait_for_ranks_returns_once_every_rank_arrived(store_port):
    import threading

    late = threading.Timer(0.5, lambda: _board(store_port, 1).wait_for_ranks(5, print))
    late.start()
    _board(store_port, 0).wait_for_ranks(5, lambda m: None)
    late.join()


def test_peer_loss_names_the_failed_rank_and_quotes_it(store_port):
    from megatron_qrl.utils.ranks import peer_loss

    rank0, rank1 = _board(store_port, 0), _board(store_port, 1)
    rank1.record_failure("--qrl-resume: no checkpoint in /x")
    exc = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                       "[127.0.0.1]:4242")
    assert peer_loss(exc, rank0, 600, settle_s=0) == \
        "lost rank 1, which failed: --qrl-resume: no checkpoint in /x"


def test_peer_loss_without_a_recorded_line_names_the_rank_at_the_address(store_port):
    from megatron_qrl.utils.ranks import peer_loss

    rank0, rank1 = _board(store_port, 0), _board(store_port, 1)
    rank1.store().set(rank1.key("rank", 1), "1 10.0.0.2")  # what wait_for_ranks registers
    exc = RuntimeError("Connection reset by peer [10.0.0.2]:5151")
    line = peer_loss(exc, rank0, 600, settle_s=0.3)
    assert line.startswith("lost rank 1 at 10.0.0.2: its process ended or its node is gone")
    frozen = RuntimeError("[gloo] Timed out waiting 600000ms for recv operation to complete")
    assert peer_loss(frozen, rank0, 600).startswith(
        "no answer from the other ranks within 600 s (--qrl-launch-collective-timeout-s)")
    assert peer_loss(ValueError("a bug"), rank0, 600) is None


def test_peer_loss_when_the_store_is_gone_too():
    from megatron_qrl.utils.ranks import peer_loss

    with socket.socket() as s:  # a port nobody listens on: node 0 (the store's host) is gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    board = _board(port, 1)
    board.timeout_s = 1
    line = peer_loss(RuntimeError("Connection closed by peer [127.0.0.1]:1"), board, 60,
                     settle_s=0)
    assert line.startswith("lost a peer rank at 127.0.0.1: its process ended")


def test_rank_label():
    from megatron_qrl.utils.ranks import rank_label

    assert rank_label({"WORLD_SIZE": "4", "GROUP_RANK": "1", "RANK": "3"}) == "node 1 rank 3"
    assert rank_label({}) == ""
