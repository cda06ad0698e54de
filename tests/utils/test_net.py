"""utils.net.free_port: a port outside the kernel's ephemeral range (where torchrun + Ray
tests lost their rendezvous port to an outgoing connection), bindable, and the fallback."""

from __future__ import annotations

import socket

from megatron_qrl.utils import net


def test_port_is_below_the_ephemeral_range_and_bindable():
    high = net.ephemeral_low()
    for _ in range(20):
        port = net.free_port()
        assert net.LOW <= port < high
        with socket.socket() as s:
            s.bind(("", port))


def test_taken_ports_are_skipped(monkeypatch):
    taken = socket.socket()
    for _ in range(20):  # a taken port whose neighbour is free
        port = net.free_port()
        if net._bindable("", port + 1):
            break
    taken.bind(("", port))
    taken.listen()
    monkeypatch.setattr(net, "LOW", port)
    monkeypatch.setattr(net, "ephemeral_low", lambda: port + 2)
    try:
        assert {net.free_port() for _ in range(10)} == {port + 1}
    finally:
        taken.close()


def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernel(monkeypatch):
    monkeypatch.setattr(net, "ephemeral_low", lambda: net.LOW)
    port = net.free_port()
    with socket.socket() as s:
        s.bind(("", port))
