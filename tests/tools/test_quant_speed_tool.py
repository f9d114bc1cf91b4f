"""tools/gpu_quant_speed.py: a recipe's ``@SETTING/SETTING`` part becomes the environment its ``ninfer bench`` runs
in (the decode candidates' A/B on one artifact), an unknown setting is named, and (slow, tiny, on the CPU)
consecutive recipes of one format share one conversion while each is benched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from frontend.conftest import tokenizer_json_path  # noqa: F401 - the Qwen vocabulary the tool's frontend names

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))


def test_recipe_settings_become_the_environment():
    import gpu_quant_speed as qs

    assert qs.setting_env("") == {}
    assert qs.setting_env("wave/pf/sep") == {"NINFER_QUANT_SPLIT": "wave", "NINFER_QUANT_PREFETCH": "1",
                                             "NINFER_QUANT_NORM": "separate"}
    assert qs.setting_env("cuda") == {"NINFER_QUANT_GEMV": "cuda"}
    assert qs.setting_env("streamk/l2") == {"NINFER_QUANT_SPLIT": "streamk", "NINFER_QUANT_L2_PREFETCH": "1"}
    assert qs.setting_env("l2/sep") == {"NINFER_QUANT_L2_PREFETCH": "1", "NINFER_QUANT_NORM": "separate"}
    with pytest.raises(ValueError,
                       match="recipe setting 'fast': expected one of auto, tc, cuda, fill, wave, streamk, pf, sep, l2"):
        qs.setting_env("wave/fast")


@pytest.mark.skipif(not os.environ.get("NINFER_RUN_SLOW"), reason="slow: set NINFER_RUN_SLOW=1 to run it")
def test_one_conversion_per_format(tokenizer_json_path, tmp_path):  # noqa: F811
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_quant_speed.py"), "--tiny", "--device", "cpu",
                          "--tokenizer", str(tokenizer_json_path), "--out", str(tmp_path / "out"),
                          "--work", str(tmp_path / "work"), "--recipes", "q4,q4@wave/sep,q4@bogus,bf16"],
                         capture_output=True, text=True, timeout=900)
    results = {r["recipe"]: r for r in json.loads((tmp_path / "out" / "quant_speed.json").read_text())["results"]}
    assert run.returncode == 1, run.stderr[-2000:]           # the bogus recipe's error, the others' figures kept
    assert "convert_s" in results["q4"] and "convert_s" not in results["q4@wave/sep"]
    assert results["q4@wave/sep"]["decode"] and results["bf16"]["decode"] and "convert_s" in results["bf16"]
    assert "recipe setting 'bogus'" in results["q4@bogus"]["error"]
    assert not list((tmp_path / "work").glob("*.ninfer*"))   # the last artifact removed too
