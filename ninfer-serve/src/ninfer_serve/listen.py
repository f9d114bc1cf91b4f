"""Reserving the server's address before the model loads, so a port in use fails at once; and whether that
address is reachable only from this machine (:func:`is_loopback`).

The socket is bound, not listening: until the server takes it over (:func:`ninfer_serve.server.serve`), a
client's connection is refused rather than left waiting in a backlog, so "connects" means "answers".
Standard library only: ``ninfer serve`` calls this before importing the HTTP stack or loading weights.
"""

from __future__ import annotations

import ipaddress
import socket

from ninfer.errors import NInferError


class AddressInUseError(NInferError):
    """The server's host:port cannot be bound (in use, not an address of this machine, or not allowed)."""


def reserve_address(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)``, not yet listening; the caller hands it to the server or
    closes it. Raises :class:`AddressInUseError` naming the address and the flags that set it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise AddressInUseError(f"cannot listen on {host}:{port}: {exc.strerror} (--host {host})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn does: a restart may bind while the last run's connections are in TIME_WAIT (never while
    # another socket listens on the port).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise AddressInUseError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another --port (or --host)"
                                ) from None
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` listens on loopback only: every address it resolves to is a loopback address
    (127.0.0.0/8, ::1, their IPv4-mapped forms). The wildcards ``0.0.0.0`` and ``::`` (every interface), a
    machine's own network address and an unresolvable name are not."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(_loopback_address(info[4][0]) for info in infos)


def _loopback_address(text: str) -> bool:
    address = ipaddress.ip_address(text.split("%", 1)[0])  # an IPv6 scope id ("fe80::1%eth0") is not part of it
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback
