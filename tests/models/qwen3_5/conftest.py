"""Fixtures of the Qwen3.5 tests; the builders and drivers live in :mod:`harness`."""

from __future__ import annotations

import pytest
from support.fixtures import single_torch_thread  # noqa: F401 (autouse for this package)

from .harness import Cases


@pytest.fixture(scope="session")
def qwen_case(tmp_path_factory):
    """``qwen_case(name)`` -> :class:`harness.Case`, built once per session."""
    return Cases(tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="session")
def vision_case(tmp_path_factory):
    """``vision_case(kind)`` -> :class:`vision_harness.VisionCase` ("dense" or "moe"), built once per session."""
    from .vision_harness import build_case

    root = tmp_path_factory.mktemp("qwen3_5_vision")
    built: dict = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = build_case(kind, root, seed={"dense": 21, "moe": 22}[kind])
        return built[kind]

    return get
