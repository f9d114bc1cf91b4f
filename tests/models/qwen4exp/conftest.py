"""Fixtures of the Qwen4-Exp tests; the builders and drivers live in :mod:`harness`."""

from __future__ import annotations

import pytest
from support.fixtures import single_torch_thread  # noqa: F401 (autouse for this package)

from .harness import Cases


@pytest.fixture(scope="session")
def q4x_case(tmp_path_factory):
    """``q4x_case(name)`` -> :class:`harness.Case`, built once per session."""
    pytest.importorskip("transformers.models.qwen4_exp")
    return Cases(tmp_path_factory.mktemp("qwen4exp"))
