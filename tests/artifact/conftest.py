"""Fixtures for the artifact tests; the builders live in artifact_testlib.py."""

from __future__ import annotations

import pytest
from artifact_testlib import SMALL_LIMIT, Tiny, make_tiny


@pytest.fixture
def tiny(tmp_path) -> Tiny:
    return make_tiny(tmp_path / "tiny.ninfer")


@pytest.fixture
def tiny_parts(tmp_path) -> Tiny:
    return make_tiny(tmp_path / "tiny.ninfer", max_file_bytes=SMALL_LIMIT)
