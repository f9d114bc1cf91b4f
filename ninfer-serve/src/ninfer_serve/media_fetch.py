"""Fetching a remote image or video for a request, without letting the request reach the server's own network.

Invariants (``fetch``): only http and https; the host name is resolved here once and every address it resolves to
must pass the policy's address check, and the connection goes to the vetted address (no second resolution a DNS
answer could change in between); a redirect (at most ``max_redirects``) is a new URL checked the same way; the
connection and every read time out after ``timeout_s``, and the whole fetch after twice that; the body is read in
chunks and dropped as soon as it passes ``max_bytes`` (a declared Content-Length over it is refused before
reading). Every refusal is a 400 that names the problem.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

from ninfer_serve.errors import ApiError, bad_request
from ninfer_serve.media_policy import MediaPolicy, address_refusal

CHUNK = 64 * 1024
Resolver = Callable[[str, int], list[str]]


def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (TCP)."""
    return sorted({info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a vetted address, with the certificate checked for the URL's host name."""

    def __init__(self, address: str, host: str, port: int, timeout: float, context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


class _PinnedHTTP(http.client.HTTPConnection):
    def __init__(self, address: str, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


def fetch(url: str, policy: MediaPolicy, param: str, *, resolver: Resolver = resolve,
          refusal: Callable[[str], str | None] = address_refusal) -> bytes:
    """The body of ``url`` under ``policy`` (see the module docstring); ``resolver`` and ``refusal`` are the
    name lookup and the address check (replaceable so tests can serve from a loopback address)."""
    if not policy.allow_remote:
        raise bad_request("remote media is off: start the server with --allow-remote-media to fetch http(s) URLs",
                          param=param)
    deadline = time.monotonic() + 2 * policy.timeout_s
    for _ in range(policy.max_redirects + 1):
        status, location, body = _get(url, policy, param, resolver, refusal, deadline)
        if location is None:
            if status != 200:
                raise bad_request(f"fetching {url} answered HTTP {status}", param=param)
            return body
        url = urljoin(url, location)
    raise bad_request(f"fetching media followed more than {policy.max_redirects} redirects", param=param)


def _get(url: str, policy: MediaPolicy, param: str, resolver: Resolver, refusal: Callable[[str], str | None],
         deadline: float) -> tuple[int, str | None, bytes]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad_request(f"media URL {url!r}: only http and https URLs with a host can be fetched", param=param)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = resolver(parts.hostname, port)
    except OSError as exc:
        raise bad_request(f"media host {parts.hostname!r} does not resolve: {exc}", param=param) from None
    if not addresses:
        raise bad_request(f"media host {parts.hostname!r} does not resolve", param=param)
    for address in addresses:
        why = refusal(address)
        if why is not None:
            raise bad_request(f"media URL {url!r} refused: {parts.hostname} resolves to {why}", param=param)
    timeout = max(0.001, min(policy.timeout_s, deadline - time.monotonic()))
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = _PinnedHTTPS(addresses[0], parts.hostname, port, timeout,
                                                         ssl.create_default_context())
    else:
        conn = _PinnedHTTP(addresses[0], parts.hostname, port, timeout)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        conn.request("GET", path, headers={"User-Agent": "ninfer-serve", "Accept": "image/*, video/*"})
        resp = conn.getresponse()
        if resp.status in (301, 302, 303, 307, 308):
            return resp.status, resp.getheader("Location") or "", b""
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > policy.max_bytes:
            raise _too_large(url, policy, param)
        body = bytearray()
        while True:
            if time.monotonic() > deadline:
                raise bad_request(f"fetching {url} took longer than {2 * policy.timeout_s:g} s", param=param)
            chunk = resp.read(CHUNK)
            if not chunk:
                break
            body += chunk
            if len(body) > policy.max_bytes:
                raise _too_large(url, policy, param)
        return resp.status, None, bytes(body)
    except ApiError:
        raise
    except TimeoutError:
        raise bad_request(f"fetching {url} timed out after {policy.timeout_s:g} s", param=param) from None
    except (OSError, http.client.HTTPException) as exc:
        raise bad_request(f"fetching {url} failed: {exc}", param=param) from None
    finally:
        conn.close()


def _too_large(url: str, policy: MediaPolicy, param: str) -> ApiError:
    return bad_request(f"media at {url} exceeds {policy.max_bytes} bytes (the server's media size limit)",
                       param=param)
