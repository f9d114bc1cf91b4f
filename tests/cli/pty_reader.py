"""Reading a child's output from a pseudo-terminal in order, one expected marker at a time."""

from __future__ import annotations

import os
import select
import time


class PtyReader:
    """Reads the master side of a pty.

    Invariant: every byte the child wrote is handed out exactly once, in order. ``read_until`` returns
    the output up to and including the marker and keeps whatever came after it in the same read for
    the next call, so two markers that arrive in one chunk are both found.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self._pending = b""

    def read_until(self, needle: bytes, timeout: float) -> bytes:
        buf, end = self._pending, time.monotonic() + timeout
        while needle not in buf:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {needle!r}; got {buf[-500:]!r}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # the child closed the terminal
                chunk = b""
            if not chunk:
                raise AssertionError(f"the terminal closed before {needle!r}; got {buf[-500:]!r}")
            buf += chunk
        cut = buf.index(needle) + len(needle)
        self._pending = buf[cut:]
        return buf[:cut]
