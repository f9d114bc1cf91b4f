"""Fixtures shared by several test packages; a package's conftest imports the ones it wants."""

from __future__ import annotations

import pytest
from ninfer.testing import torch_threads


@pytest.fixture(autouse=True, scope="package")
def single_torch_thread():
    """Tiny models and many tiny ops on a small shared machine: intra-op threads only add barrier spinning
    (10x slower here). Restored afterwards for the rest of the suite."""
    with torch_threads(1):
        yield
