"""Suite-wide test policy: ``gpu`` tests skip without CUDA (tools/gpu_tests.sh runs them on a GPU machine).

Skipping is decided here, once, so individual tests never call pytest.skip for that reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# transformers prefers an installed flash-linear-attention for Qwen3.5, which cannot run on CPU
# tensors; the oracle must use transformers' own torch path.
sys.modules.setdefault("fla", None)
sys.modules.setdefault("causal_conv1d", None)


# Property tests (hypothesis): deterministic everywhere. ``derandomize`` draws the examples from each test's own
# name, so every run and every machine tries the same cases; no example database (nothing is replayed from a
# previous run); a bounded number of examples keeps the suite fast; no deadline, so a loaded machine cannot fail a
# test by being slow. ``HYPOTHESIS_PROFILE=explore`` searches further with fresh random examples (a local hunt for
# bugs: a failure prints the reproducing example; add it as an explicit case).
def _register_hypothesis_profiles() -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # the GPU lane's environment may not have it; the property tests then skip themselves
        return
    slow_ok = [HealthCheck.too_slow, HealthCheck.data_too_large]
    settings.register_profile("ci", derandomize=True, database=None, max_examples=60, deadline=None,
                              print_blob=True, suppress_health_check=slow_ok)
    settings.register_profile("explore", derandomize=False, database=None, max_examples=2000, deadline=None,
                              print_blob=True, suppress_health_check=slow_ok)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_register_hypothesis_profiles()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NINFER_RUN_SLOW") != "1":
        skip_slow = pytest.mark.skip(reason="slow: set NINFER_RUN_SLOW=1 to run it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_interpreted = pytest.mark.skip(reason="a whole model through interpreted Triton kernels: minutes on a CPU "
                                               "(the GPU lane runs it natively; NINFER_RUN_SLOW=1 runs it here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        elif "slow_interpreted" in item.keywords and os.environ.get("NINFER_RUN_SLOW") != "1":
            item.add_marker(skip_interpreted)


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory) -> Path:
    """A private NINFER_CACHE_DIR holding the embedded default model, converted once per session (for
    subprocesses that resolve the default model themselves)."""
    from ninfer.testing import default_model_in

    cache = tmp_path_factory.mktemp("ninfer-cache")
    default_model_in(cache)
    return cache


@pytest.fixture(scope="session")
def default_artifact(default_model_cache) -> Path:
    """The embedded default model's artifact in ``default_model_cache``."""
    from ninfer.testing import default_model_in

    return default_model_in(default_model_cache)  # already converted: only the lookup
