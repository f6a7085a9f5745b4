"""Ports for the servers a process is about to start (rendezvous, gRPC receivers, Ray nodes in tests)."""

from __future__ import annotations

import socket
import threading

__all__ = ["free_port", "port_taken"]

_lock = threading.Lock()
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it) and that this process has not handed out
    before, so the several servers one process starts (a Ray node's six ports, the nodes of a test cluster) never get
    the same one: the OS may pick a just-released port again. Another process can still take it before the caller
    binds it."""
    with _lock:
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def port_taken(port: int, host: str = "127.0.0.1") -> str | None:
    """Why a server could not listen on ``host:port`` now (another process holds it), or None when it could; the
    caller binds it later, so another process can still take it in between."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a closed socket's port is free
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None
