"""Fixtures of the engine tests: engines over the toy Program, and a tiny random Qwen3.5 artifact.

Every engine a test makes is closed at teardown, and the test fails if a worker thread survives.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from ninfer import Engine, EngineOptions
from support.fixtures import single_torch_thread  # noqa: F401 (autouse for this package)
from support.models import tiny_qwen_artifact as build_tiny_qwen

from .doubles import ToyFrontend, ToyProgram

_WORKER = "ninfer-engine-worker"
# Worker threads alive when the current test began: engines another directory's session-scoped fixture keeps
# open (the serve tests' shared engine, when they run first in the same process) are not this test's to reap.
_preexisting: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _note_preexisting_workers():
    _preexisting.clear()
    _preexisting.update(t for t in threading.enumerate() if t.name == _WORKER)
    yield


def worker_threads() -> list[threading.Thread]:
    """Engine worker threads started since the current test began and still alive."""
    return [t for t in threading.enumerate() if t.name == _WORKER and t not in _preexisting]


@pytest.fixture
def make_toy_engine():
    """``make_toy_engine(program_kwargs=..., **engine_options) -> (engine, program, frontend)``."""
    made: list[Engine] = []

    def make(program_kwargs: dict | None = None, frontend: ToyFrontend | None = None, **options):
        program = ToyProgram(**(program_kwargs or {}))
        frontend = frontend or ToyFrontend(vocab_size=program.vocab_size)
        options.setdefault("max_context", 64)
        engine = Engine.from_parts(program, frontend, EngineOptions(**options))
        made.append(engine)
        return engine, program, frontend

    yield make
    for engine in made:
        engine.close(timeout=30)
    assert not worker_threads(), "an engine worker thread outlived its test"


# -- a tiny random Qwen3.5 checkpoint, converted once per session -----------------------------------

TINY_CONFIG = dict(
    vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    tie_word_embeddings=False)
IM_END, ENDOFTEXT = 258, 256


def _tiny_qwen(root: Path, dtype_name: str) -> Path:
    """A random Qwen3_5ForCausalLM (4 layers: 3 GDN + 1 attention) built with transformers in
    ``dtype_name``, saved with save_pretrained and converted with ninfer.conversion."""
    pytest.importorskip("transformers")
    return build_tiny_qwen(root, TINY_CONFIG, seed=1234, std=0.25, dtype_name=dtype_name)


@pytest.fixture(scope="session")
def tiny_qwen_artifact(tmp_path_factory) -> Path:
    """The tiny model in float32 (the CPU reference-ops oracle setting)."""
    return _tiny_qwen(tmp_path_factory.mktemp("tiny_qwen"), "float32")


@pytest.fixture(scope="session")
def tiny_qwen_artifact_bf16(tmp_path_factory) -> Path:
    """The same tiny model stored in bfloat16 (the GPU serving setting)."""
    return _tiny_qwen(tmp_path_factory.mktemp("tiny_qwen_bf16"), "bfloat16")


# -- the plain (non-speculative) references of the speculative engine tests, computed once per test run -------------

@pytest.fixture(scope="session")
def plain_code(default_artifact) -> dict:
    """Every ``test_speculative_engine.CODE`` prompt alone on the default model without speculation: greedy and
    seeded token ids. The reference of the MTP engine tests and of the DFlash ones (a DFlash artifact's text part
    is the default model, so its plain tokens are these)."""
    from .test_speculative_engine import CODE, GREEDY, SEEDED, start

    with start(default_artifact, max_concurrency=1) as engine:
        return {"greedy": [engine.generate(p, sampling=GREEDY).token_ids for p in CODE],
                "seeded": [engine.generate(p, sampling=SEEDED).token_ids for p in CODE]}
