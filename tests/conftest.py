"""Suite-wide test policy: ``gpu`` tests skip without CUDA, ``slow`` tests run only with NINFER_SLOW_TESTS=1.

Skipping is decided here, once, so individual tests never call pytest.skip for these reasons.
"""

from __future__ import annotations

import os
import sys

import pytest

# transformers prefers an installed flash-linear-attention for Qwen3.5, which cannot run on CPU
# tensors; the oracle must use transformers' own torch path.
sys.modules.setdefault("fla", None)
sys.modules.setdefault("causal_conv1d", None)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda_available()
    run_slow = os.environ.get("NINFER_SLOW_TESTS") == "1"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow test: set NINFER_SLOW_TESTS=1 to run")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
