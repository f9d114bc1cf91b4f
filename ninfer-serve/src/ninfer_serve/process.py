"""Starting a server process and waiting for it: a free local port, and a wait until ``/health`` answers.

For supervisors, benchmarks and tests that run ``ninfer serve`` (or another ASGI server) as a child
process. Standard library only (no HTTP client dependency).
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request


class ServerStartError(RuntimeError):
    """The server process exited, or did not answer ``/health`` with 200 in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(base_url: str, proc: subprocess.Popen, timeout: float, poll_s: float = 0.1) -> None:
    """Return once ``GET base_url/health`` answers 200; raise :class:`ServerStartError` if ``proc`` exits
    first or ``timeout`` seconds pass (the caller owns ``proc`` and decides how to stop it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if proc.poll() is not None:
            raise ServerStartError(f"the server process exited with code {proc.returncode} before {base_url} "
                                   f"answered /health")
        if time.monotonic() > deadline:
            raise ServerStartError(f"{base_url}/health did not answer 200 within {timeout:g} s")
        time.sleep(poll_s)
