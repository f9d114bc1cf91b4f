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
        # A host without a C compiler with OpenMP (a minimal CI image) cannot run the kernel at all; the engine's
        # refusal there is itself tested with a failing compiler (test_host_native's build test, which needs none).
        pytest.skip(str(exc))
