"""``common.net.free_port``: a port the OS says is free, never one this process handed out before."""

from __future__ import annotations

import socket

import pytest

from common import net


def test_ports_are_bindable_and_distinct() -> None:
    ports = [net.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: nobody holds it


def test_a_port_the_os_picks_again_is_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    first = net.free_port()
    picks = iter([first, first, *range(1024, 65536)])  # the OS offers ``first`` twice more, then others

    class Repeating(socket.socket):
        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", next(picks))

    monkeypatch.setattr(net.socket, "socket", Repeating)
    assert net.free_port() != first
