"""A free TCP port for a rendezvous store that is bound a moment later.

The port is picked now and bound later (by the store of a gloo / NCCL group, possibly in
another process), so something else can take it in between. A port from the kernel's
ephemeral range (``bind(0)``) is exactly what the next outgoing connection may get — and a
Ray job opens many — which made a torchrun + Ray test fail now and then with ``EADDRINUSE``.
So the port is drawn from ``[20000, first ephemeral port)``: above Ray's worker ports
(``--min-worker-port`` 10002 .. ``--max-worker-port`` 19999 by default), below the range
outgoing connections use; the ephemeral range is the fallback when no port there is free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

LOW = 20000
"""First port drawn from (Ray's default worker ports end at 19999)."""
_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 64


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` now, outside the ephemeral range where possible (module
    doc); the default ``host=""`` checks every interface, as the store binds."""
    high = ephemeral_low()
    if high > LOW:
        rng = random.SystemRandom()
        for _ in range(_TRIES):
            port = rng.randrange(LOW, high)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
