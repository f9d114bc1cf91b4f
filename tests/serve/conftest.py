"""Fixtures of the HTTP gateway tests.

One real engine per session (the embedded default model, CPU, bfloat16, converted once into a
session cache dir) and one scripted engine (tests/serve/serve_scripted.py: exact output through the same
real frontend). Each test builds its own app over them (cheap); apps never share metrics.
"""

from __future__ import annotations

import os

import pytest
from serve_helpers import scripted_engine


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ninfer_cache")
    old = os.environ.get("NINFER_CACHE_DIR")
    os.environ["NINFER_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("NINFER_CACHE_DIR", None)
    else:
        os.environ["NINFER_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def artifact(cache_dir):
    from ninfer.model_source import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def engine(artifact):
    from ninfer import Engine
    from ninfer_serve.warmup import warm_up

    eng = Engine.start(artifact, device="cpu", dtype="bfloat16", max_concurrency=2, max_context=512,
                       queue_capacity=4)
    warm_up(eng)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def scripted(engine):
    eng = scripted_engine(engine.frontend)
    yield eng
    eng.close()


