"""Where a request's images and videos may come from (the server operator's choice, fixed at start).

Invariants: a ``data:`` URL is always accepted (its bytes are in the request, bounded by the body limit and by
``max_bytes``); a local file only when ``allowed_paths`` is set and the path, resolved through every symlink, lies
inside one of those folders; an http(s) URL only with ``allow_remote`` and, for every address the name resolves to
and every redirect, only a public unicast address (no loopback, private, link-local, multicast, reserved or
unspecified address, IPv4-mapped forms included): the server must not become a way into the network it runs in.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from ninfer_serve.errors import bad_request

DEFAULT_MAX_MEDIA_BYTES = 20 * 1024 * 1024
DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaPolicy:
    """The media sources a server accepts. ``allowed_paths`` are resolved absolute folders."""

    allowed_paths: tuple[Path, ...] = ()
    allow_remote: bool = False
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_redirects: int = DEFAULT_MAX_REDIRECTS

    @classmethod
    def of(cls, allowed_paths=(), allow_remote: bool = False, **limits) -> MediaPolicy:
        folders = []
        for p in allowed_paths:
            folder = Path(p).expanduser().resolve()
            if not folder.is_dir():
                raise ValueError(f"--allowed-media-path {p}: not a folder")
            folders.append(folder)
        return cls(tuple(folders), allow_remote, **limits)

    def local_path(self, raw: str, param: str) -> Path:
        """The file a path or ``file://`` URL names, if the policy allows it (else a 400 naming why)."""
        if not self.allowed_paths:
            raise bad_request("local media files are off: start the server with --allowed-media-path DIR to serve "
                              "files from DIR", param=param)
        text = raw[len("file://"):] if raw.startswith("file://") else raw
        try:
            path = Path(os.path.realpath(text))
        except (OSError, ValueError) as exc:
            raise bad_request(f"media path {raw!r} cannot be resolved: {exc}", param=param) from None
        if not any(path.is_relative_to(folder) for folder in self.allowed_paths):
            raise bad_request(f"media path {raw!r} is outside the allowed media folders", param=param)
        if not path.is_file():
            raise bad_request(f"media path {raw!r} is not a file", param=param)
        return path


def address_refusal(address: str) -> str | None:
    """Why a remote media fetch may not connect to ``address`` (None: a public unicast address)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    # The specific kinds first: ipaddress counts link-local, unspecified and reserved addresses as private too.
    for test, what in ((ip.is_loopback, "loopback"), (ip.is_link_local, "link-local"), (ip.is_multicast, "multicast"),
                       (ip.is_unspecified, "unspecified"), (ip.is_reserved, "reserved"), (ip.is_private, "private")):
        if test:
            return f"address {ip} is {what}"
    if not ip.is_global:
        return f"address {ip} is not a public address"
    return None
