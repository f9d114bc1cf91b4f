"""The embedded default model this plugin ships: a small Qwen3_5ForCausalLM trained on the Python
standard library (``docs/default-model.md``; rebuilt by ``tools/train_default_model.py``), with its DFlash and
DFlash2 drafters (z-lab folders, ``tools/train_dflash.py``; ``docs/speculative.md``). Its MTP layer is inside
the checkpoint itself."""

from __future__ import annotations

from pathlib import Path

from ninfer.model_source import DefaultModel
from ninfer.plugins.hookspecs import hookimpl

FOLDER = Path(__file__).parent / "qwen3_5-stdlib"
DRAFTS = {kind: Path(__file__).parent / f"qwen3_5-stdlib-{kind}" for kind in ("dflash", "dflash2")}


@hookimpl
def ninfer_default_models() -> list:
    return [DefaultModel(name="qwen3_5-stdlib", source=FOLDER,
                         description="8-layer Qwen3.5 (6.9M params) trained on CPython's Lib/, for offline use",
                         drafts=DRAFTS)]
