"""tools/serve_bursts.py: the configuration names map to the ``ninfer serve`` flags they stand for."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import serve_bursts  # noqa: E402

ARGS = types.SimpleNamespace(long=8192, max_concurrency=8)


@pytest.mark.parametrize("name, flags", [
    ("default", []),
    ("nowarmup", ["--no-warmup"]),
    ("ttft", ["--max-step-tokens", "8200"]),
    ("256", ["--max-step-tokens", "256"]),
    ("graphs", ["--prefill-graphs"]),
    ("graphs512", ["--prefill-graphs", "--max-step-tokens", "512"]),
    ("eager", ["--no-prefill-graphs"]),
    ("eager2048", ["--no-prefill-graphs", "--max-step-tokens", "2048"]),
])
def test_config_names(name, flags):
    assert serve_bursts.config_flags(name, ARGS) == flags


def test_an_unknown_config_name_is_refused():
    with pytest.raises(ValueError):
        serve_bursts.config_flags("fast", ARGS)
