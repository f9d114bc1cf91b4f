"""The native host-expert kernel in tests: built once per process, or the test skipped naming why."""

from __future__ import annotations

import pytest
from ninfer.errors import NotSupportedError


def require_native_kernel() -> None:
    """Build (or load) the native host-expert kernel; skip the calling test when this host cannot build it (no C
    compiler with OpenMP), with the engine's own message."""
    from ninfer_qwen3_5.layers import host_native

    try:
        host_native.library()
    except NotSupportedError as exc:
        pytest.skip(str(exc))
