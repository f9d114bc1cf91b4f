"""The embedded default model this plugin ships: a small Qwen3_5ForCausalLM trained on the Python
standard library (``docs/default-model.md``; rebuilt by ``tools/train_default_model.py``)."""

from __future__ import annotations

from pathlib import Path

from ninfer.model_source import DefaultModel
from ninfer.plugins.hookspecs import hookimpl

FOLDER = Path(__file__).parent / "qwen3_5-stdlib"


@hookimpl
def ninfer_default_models() -> list:
    return [DefaultModel(name="qwen3_5-stdlib", source=FOLDER,
                         description="8-layer Qwen3.5 (6.9M params) trained on CPython's Lib/, for offline use")]
