"""Fixtures of the context-cache tests: a tiny random Qwen3.5 artifact with a long position range
(8k-token multi-turn prompts), engines over it with fp32 reference ops on the CPU, closed at teardown."""

from __future__ import annotations

from pathlib import Path

import pytest
from ninfer.testing import settled  # noqa: F401 (the package's tests import it from here)
from support.fixtures import single_torch_thread  # noqa: F401 (autouse for this package)
from support.models import tiny_qwen_artifact

IM_START, IM_END, ENDOFTEXT = 257, 258, 256
THINK, END_THINK = 259, 260

TINY_LONG = dict(
    vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=1, linear_num_value_heads=2, max_position_embeddings=16384,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    tie_word_embeddings=False)


@pytest.fixture(scope="session")
def long_tiny_artifact(tmp_path_factory) -> Path:
    """A random 4-layer Qwen3.5 (3 GDN + 1 attention) with 16k positions, float32, converted."""
    pytest.importorskip("transformers")
    artifact = tiny_qwen_artifact(tmp_path_factory.mktemp("cc_tiny"), TINY_LONG, seed=4321, std=0.3)
    return artifact


@pytest.fixture
def make_engine(long_tiny_artifact):
    """``make_engine(**options) -> Engine`` on the long tiny artifact (cpu, float32); closed at teardown."""
    from ninfer import Engine, EngineOptions

    made = []

    def make(**options):
        options.setdefault("device", "cpu")
        options.setdefault("dtype", "float32")
        options.setdefault("page_size", 16)
        engine = Engine.start(long_tiny_artifact, EngineOptions(**options))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close(timeout=60)
