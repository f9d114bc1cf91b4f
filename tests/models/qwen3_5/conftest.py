"""Fixtures of the Qwen3.5 tests; the builders and drivers live in :mod:`harness`."""

from __future__ import annotations

import pytest

from .harness import Cases


@pytest.fixture(scope="session")
def qwen_case(tmp_path_factory):
    """``qwen_case(name)`` -> :class:`harness.Case`, built once per session."""
    return Cases(tmp_path_factory.mktemp("qwen3_5"))
