"""A free TCP port on localhost, for the local servers, process groups and daemons that tests and benchmarks start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it); another process may take it before the caller binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
