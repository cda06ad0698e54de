"""The ranks of a multi-node ``torchrun`` job: who this rank is, who is missing, who was lost.

Every rank of a failing job prints its OWN one-line error, prefixed with :func:`rank_label`
(``node 1 rank 3``), and exits non-zero; a rank that loses a peer says which one. The ranks
share torchrun's store (the ``MASTER_ADDR:MASTER_PORT`` rendezvous): :class:`RankBoard`
writes there

* at start, each rank's node and address (``qrl/rank/<r>``) and its arrival; a rank then
  waits for the others (:meth:`RankBoard.wait_for_ranks`), saying which nodes it waits for,
  up to ``--qrl-launch-startup-timeout-s`` (one line naming the missing nodes after that);
* on failure, the rank's one-line error (``qrl/failed/<r>``): a rank whose collective fails
  because its peer left (:func:`peer_loss`) names that peer and quotes its line.

A peer that could not write its line (killed, its node gone) is named from gloo's message
(the peer's address, matched against the ranks' addresses).
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["RankBoard", "StartupTimeoutError", "peer_loss", "rank_label"]

_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
         "connection refused", "socket closed", "end of file")
_TIMED_OUT = ("timed out", "timeout")
_PEER = re.compile(r"\[?([0-9a-fA-F.:]+?)\]?:(\d+)")


class StartupTimeoutError(RuntimeError):
    """Not every rank joined within the start-up timeout; the message names the nodes."""


def rank_label(env: Any = None) -> str:
    """``node N rank R`` of this process (torchrun's ``GROUP_RANK`` / ``RANK``); "" outside
    torchrun (``WORLD_SIZE`` unset or 1)."""
    env = os.environ if env is None else env
    if env.get("WORLD_SIZE", "1") in ("", "1"):
        return ""
    return f"node {env.get('GROUP_RANK', '?')} rank {env.get('RANK', '?')}"


def own_address() -> str:
    """This host's address on its route to ``MASTER_ADDR`` (the interface torchrun uses)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class RankBoard:
    """This rank's view of torchrun's store (module docstring); every method is best effort
    except :meth:`wait_for_ranks`."""

    PREFIX = "qrl/"

    def __init__(self, rank: int, world_size: int, timeout_s: float = 10.0,
                 env: Any = None):
        env = os.environ if env is None else env
        self.rank, self.world_size = rank, world_size
        self.node = env.get("GROUP_RANK", "?")
        self.master = f"{env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', '29500')}"
        self.run = (f"{env.get('TORCHELASTIC_RUN_ID', 'none')}."
                    f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        self.per_node = max(int(env.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
        self.timeout_s = timeout_s
        self._store: Any = None

    def store(self) -> Any:
        """A client of torchrun's store (connects on first use; raises when unreachable)."""
        if self._store is None:
            import torch.distributed as dist

            host, port = self.master.rsplit(":", 1)
            self._store = dist.TCPStore(host, int(port), is_master=False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s),
                                        wait_for_workers=False)
        return self._store

    def key(self, *parts: Any) -> str:
        return self.PREFIX + "/".join([self.run, *map(str, parts)])

    def wait_for_ranks(self, timeout_s: float, log: Callable[[str], None],
                       every_s: float = 10.0) -> None:
        """Register this rank, then wait until all ``world_size`` ranks did; every
        ``every_s`` log which nodes are missing; after ``timeout_s`` raise
        :class:`StartupTimeoutError` naming them."""
        store = self.store()
        store.set(self.key("rank", self.rank), f"{self.node} {own_address()}")
        store.add(self.key("arrived"), 1)
        start = last = time.monotonic()
        nodes = -(-self.world_size // self.per_node)
        log(f"waiting for {nodes} nodes / {self.world_size} ranks at {self.master} (up to "
            f"{timeout_s:.0f} s, --qrl-launch-startup-timeout-s)")
        while store.add(self.key("arrived"), 0) < self.world_size:
            now = time.monotonic()
            if now - start > timeout_s:
                raise StartupTimeoutError(
                    f"waited {timeout_s:.0f} s for {self._missing()} to join {self.master}; "
                    "start them (torchrun --node-rank N with the same --master-addr / "
                    "--master-port) or raise --qrl-launch-startup-timeout-s")
            if now - last >= every_s:
                log(f"still waiting for {self._missing()} ({now - start:.0f} s)")
                last = now
            time.sleep(0.2)

    def _missing(self) -> str:
        store = self.store()
        missing = [r for r in range(self.world_size)
                   if not store.check([self.key("rank", r)])]
        if not missing:
            return "the last rank"
        nodes = sorted({r // self.per_node for r in missing})
        return f"node{'s' if len(nodes) > 1 else ''} {nodes} (ranks {missing})"

    def record_failure(self, line: str) -> None:
        """Leave this rank's one-line error for the peers that lose it (never raises)."""
        try:
            self.store().set(self.key("failed", self.rank), line)
        except Exception:  # noqa: BLE001 - the store's host may be gone too
            pass

    def failures(self) -> dict[int, str]:
        """Other ranks' recorded one-line errors (empty when the store is unreachable)."""
        try:
            store = self.store()
            return {r: store.get(self.key("failed", r)).decode()
                    for r in range(self.world_size)
                    if r != self.rank and store.check([self.key("failed", r)])}
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing recorded
            return {}

    def ranks_at(self, address: str) -> list[int]:
        """The other ranks registered at ``address``."""
        try:
            store = self.store()
            out = []
            for r in range(self.world_size):
                if r != self.rank and store.check([self.key("rank", r)]):
                    if store.get(self.key("rank", r)).decode().split()[-1] == address:
                        out.append(r)
            return out
        except Exception:  # noqa: BLE001 - the store's host is gone
            return []


def peer_loss(exc: BaseException, board: RankBoard | None, collective_timeout_s: float,
              settle_s: float = 5.0) -> str | None:
    """One line for a collective that failed because a peer left or froze; None for any
    other error. ``settle_s``: time given to the lost peer to record its own line."""
    text = str(exc).lower()
    lost = any(k in text for k in _LOST)
    if not lost and not any(k in text for k in _TIMED_OUT):
        return None
    if not lost:
        return (f"no answer from the other ranks within {collective_timeout_s:.0f} s "
                "(--qrl-launch-collective-timeout-s): a node froze or is overloaded; see the "
                "other nodes' lines")
    if board is None:
        return "lost a peer rank (its process ended or its node is gone)"
    deadline = time.monotonic() + settle_s
    failed = board.failures()
    while not failed and time.monotonic() < deadline:
        time.sleep(0.2)
        failed = board.failures()
    if failed:
        r, line = min(failed.items())
        return f"lost rank {r}, which failed: {line}"
    match = _PEER.search(str(exc))
    ranks = board.ranks_at(match.group(1)) if match else []
    who = (f"rank {ranks[0]}" if len(ranks) == 1 else
           f"one of ranks {ranks}" if ranks else "a peer rank")
    where = f" at {match.group(1)}" if match else ""
    return (f"lost {who}{where}: its process ended or its node is gone, without an error of "
            "its own (killed, out of memory, or the node went down)")
